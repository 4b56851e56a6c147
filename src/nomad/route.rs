//! The path of one Nomad API request: a list of segments, each percent-encoded on its own
//! when the URL is built ([`Route::url`]), so that no value (a node ID, a volume name, a
//! variable path read from a change marker) can add a query, climb out of its endpoint with
//! `..` or name another endpoint. Query pairs are added by the caller with reqwest's encoded
//! `query`, never formatted into the path.

use super::NomadError;

/// The path of a request: `/v1/<segments>`, or a root path such as `/.well-known/jwks.json`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Route {
    segments: Vec<String>,
}

/// The longest variable path Nomad takes (`nomad/structs/variables.go`, `validVariablePath`
/// `^[a-zA-Z0-9-_~/]{1,128}$`).
pub const MAX_VARIABLE_PATH: usize = 128;

impl Route {
    /// `/v1/` followed by `segments`, each one segment whatever it holds (a `/` in one is
    /// sent as `%2F`).
    pub fn v1<S: AsRef<str>>(segments: &[S]) -> Route {
        let mut all = vec!["v1".to_string()];
        all.extend(segments.iter().map(|s| s.as_ref().to_string()));
        Route { segments: all }
    }

    /// A path outside `/v1` (`/.well-known/...`), from its segments.
    pub fn root<S: AsRef<str>>(segments: &[S]) -> Route {
        Route {
            segments: segments.iter().map(|s| s.as_ref().to_string()).collect(),
        }
    }

    /// `/v1/var/<path>` for a variable path, refused unless it is one Nomad takes
    /// (`[a-zA-Z0-9-_~/]`, 1 to [`MAX_VARIABLE_PATH`] characters, `nomad/structs/variables.go`
    /// `validVariablePath`) with no empty segment: nothing in it can be a query, an
    /// encoded character or a dot segment. Errors: [`NomadError::BadRequest`].
    pub fn var(path: &str) -> Result<Route, NomadError> {
        let ok = !path.is_empty()
            && path.len() <= MAX_VARIABLE_PATH
            && path
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"-_~/".contains(&b))
            && path.split('/').all(|s| !s.is_empty());
        if !ok {
            return Err(NomadError::BadRequest {
                what: "a variable request".into(),
                reason: format!(
                    "{:?} is not a variable path (letters, digits, '-', '_', '~', segments separated by one '/', at most {MAX_VARIABLE_PATH} characters)",
                    crate::escape::escape_control(path)
                ),
            });
        }
        let mut r = Route::v1(&["var"]);
        r.segments.extend(path.split('/').map(str::to_string));
        Ok(r)
    }

    /// The URL of this route under `base` (the client's base URL, which may carry a path
    /// prefix): each segment percent-encoded on its own (`/`, `?`, `#`, `%` and the rest of
    /// the path-segment set). A segment that is empty, `.` or `..` would be a step or
    /// nothing at all, not a value: refused. Errors: [`NomadError::BadRequest`].
    pub fn url(&self, base: &reqwest::Url) -> Result<reqwest::Url, NomadError> {
        if let Some(s) = self
            .segments
            .iter()
            .find(|s| s.is_empty() || *s == "." || *s == "..")
        {
            return Err(NomadError::BadRequest {
                what: self.display(),
                reason: format!("{s:?} is no value for a path segment"),
            });
        }
        let mut url = base.clone();
        url.set_query(None);
        url.set_fragment(None);
        if let Ok(mut path) = url.path_segments_mut() {
            path.pop_if_empty().extend(&self.segments);
        }
        Ok(url)
    }

    /// The path as text, for messages and the capability hint (segments joined by `/`,
    /// not encoded: never sent).
    pub fn display(&self) -> String {
        format!("/{}", self.segments.join("/"))
    }
}

/// The capability a refused request (403) needs, by its route.
pub(super) fn capability_for(route: &Route) -> String {
    let path = route.display();
    if let Some(var) = path
        .strip_prefix("/v1/var/")
        .or_else(|| path.strip_prefix("/v1/vars"))
    {
        // dhv-binder/<kind>/<name>: the rule is on dhv-binder/<kind>/*.
        let mut parts = var.trim_start_matches('/').splitn(3, '/');
        match (parts.next(), parts.next()) {
            (Some(root), Some(kind)) if !kind.is_empty() => format!(
                "the variables capability the call takes (read, list, write or destroy) on path \"{root}/{kind}/*\" in the volume's namespace"
            ),
            _ => "variables list on path \"dhv-binder/*\" in the namespace".into(),
        }
    } else if path.starts_with("/v1/namespace") {
        "a capability in that namespace (a namespace block naming it)".into()
    } else if path.starts_with("/v1/volume") {
        "host-volume-register and host-volume-read".into()
    } else if path.starts_with("/v1/node") {
        "node:read and namespace read-job".into()
    } else if path.starts_with("/v1/client/allocation") {
        "namespace alloc-lifecycle".into()
    } else if path.starts_with("/v1/event") || path.starts_with("/v1/allocation") {
        "namespace read-job in every namespace (namespace \"*\")".into()
    } else {
        "agent:read".into()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn base() -> reqwest::Url {
        reqwest::Url::parse("http://127.0.0.1:4646").unwrap()
    }

    #[test]
    fn every_segment_is_encoded_on_its_own_and_nothing_becomes_a_query_or_a_step() {
        let url = |r: Route| r.url(&base()).unwrap().to_string();
        assert_eq!(
            url(Route::v1(&["node", "n1", "allocations"])),
            "http://127.0.0.1:4646/v1/node/n1/allocations"
        );
        // A value with a query, a fragment, a slash or a percent stays one segment.
        assert_eq!(
            url(Route::v1(&["allocation", "a?index=99999999&wait=300s#x"])),
            "http://127.0.0.1:4646/v1/allocation/a%3Findex=99999999&wait=300s%23x"
        );
        assert_eq!(
            url(Route::v1(&["node", "../../acl/token/self"])),
            "http://127.0.0.1:4646/v1/node/..%2F..%2Facl%2Ftoken%2Fself"
        );
        assert_eq!(
            url(Route::v1(&["node", "%2e%2e"])),
            "http://127.0.0.1:4646/v1/node/%252e%252e"
        );
        // Dot segments and empty ones are no values: refused.
        for bad in ["..", ".", ""] {
            assert!(
                matches!(
                    Route::v1(&["volume", "host", bad]).url(&base()),
                    Err(NomadError::BadRequest { .. })
                ),
                "{bad:?}"
            );
        }
        // A base with a path prefix keeps it.
        let prefixed = reqwest::Url::parse("https://nomad.example/api/").unwrap();
        assert_eq!(
            Route::v1(&["agent", "self"])
                .url(&prefixed)
                .unwrap()
                .as_str(),
            "https://nomad.example/api/v1/agent/self"
        );
        assert_eq!(
            url(Route::root(&[".well-known", "jwks.json"])),
            "http://127.0.0.1:4646/.well-known/jwks.json"
        );
    }

    #[test]
    fn variable_paths_nomad_refuses_are_refused_before_any_request() {
        assert_eq!(
            Route::var("dhv-binder/volumes/data~2e1")
                .unwrap()
                .url(&base())
                .unwrap()
                .as_str(),
            "http://127.0.0.1:4646/v1/var/dhv-binder/volumes/data~2e1"
        );
        for bad in [
            "",
            "dhv-binder/volumes/x?index=99999999&wait=300s",
            "dhv-binder/volumes/../../../acl/token/self",
            "dhv-binder/volumes/x?x",
            "dhv-binder//volumes",
            "/dhv-binder/volumes/x",
            "dhv-binder/volumes/",
            "dhv-binder/volumes/%2e%2e",
            "dhv-binder/volumes/x#y",
            "dhv-binder/volumes/a b",
            &"a".repeat(MAX_VARIABLE_PATH + 1),
        ] {
            assert!(
                matches!(Route::var(bad), Err(NomadError::BadRequest { .. })),
                "{bad:?}"
            );
        }
    }
}
