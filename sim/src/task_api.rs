//! The Task API: every task gets the local agent's HTTP API on a unix socket at
//! `<task dir>/secrets/api.sock`, served for as long as the task runs, and every request
//! on it must authenticate, even with ACLs disabled.
//!
//! Nomad: `client/allocrunner/taskrunner/api_hook.go` (`apiHook.Prestart` creates the
//! socket once per task and soft-fails, logging, when it cannot; `apiHook.Stop` closes and
//! removes it; `apiSocketPath` is `<SecretsDir>/api.sock`), and `command/agent/http.go`
//! (`NewHTTPServers` serves the builtin listener with `newAuthMiddleware`;
//! `authMiddleware.ServeHTTP`: no token is 401 "Unauthorized", a token `ACL.WhoAmI` refuses
//! or that is neither an ACL token nor a workload identity is 403 "Forbidden", both
//! text/plain; a failed `ACL.WhoAmI` RPC, as during a leader election, is 500 "Server error
//! authenticating request"; `parseToken` takes `X-Nomad-Token`, else `Authorization: Bearer`).

use crate::api::{router, AppState};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use hyper_util::rt::TokioIo;
use std::path::{Path, PathBuf};

/// Serves the Task API of one client agent's tasks.
#[derive(Clone)]
pub struct TaskApi {
    state: AppState,
}

impl std::fmt::Debug for TaskApi {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("TaskApi")
    }
}

/// The running socket of one task; dropping it stops serving and removes the socket.
pub struct Guard {
    path: PathBuf,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Guard {
    fn drop(&mut self) {
        self.task.abort();
        let _ = std::fs::remove_file(&self.path);
    }
}

/// The token as Nomad's `parseToken` reads it.
fn token_of(h: &HeaderMap) -> Option<String> {
    if let Some(t) = h.get("x-nomad-token").and_then(|v| v.to_str().ok()) {
        let t = t.trim();
        if !t.is_empty() {
            return Some(t.to_string());
        }
    }
    let auth = h.get("authorization").and_then(|v| v.to_str().ok())?;
    let (scheme, value) = auth.split_once(' ')?;
    scheme
        .eq_ignore_ascii_case("bearer")
        .then(|| value.split_whitespace().next().unwrap_or("").to_string())
        .filter(|t| !t.is_empty())
}

fn plain(status: StatusCode) -> Response {
    (
        status,
        [("content-type", "text/plain; charset=utf-8")],
        status.canonical_reason().unwrap_or(""),
    )
        .into_response()
}

async fn authenticate(
    axum::extract::State(st): axum::extract::State<AppState>,
    req: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    let Some(token) = token_of(req.headers()) else {
        return plain(StatusCode::UNAUTHORIZED);
    };
    // `ACL.WhoAmI` fails while the servers elect a leader: the middleware answers 500
    // "Server error authenticating request" (text/plain, with a newline).
    if st.server.read().leaderless {
        return (
            StatusCode::INTERNAL_SERVER_ERROR,
            [("content-type", "text/plain; charset=utf-8")],
            "Server error authenticating request\n",
        )
            .into_response();
    }
    if crate::acl::authenticate(&st.server, &token).is_err() {
        return plain(StatusCode::FORBIDDEN);
    }
    next.run(req).await
}

impl TaskApi {
    /// The Task API of the client agent whose HTTP state is `state`.
    pub fn new(state: AppState) -> Self {
        Self { state }
    }

    /// Binds `<secrets_dir>/api.sock` (mode 0666, as the task may run as any user) and
    /// serves it until the guard drops. Soft-fails like Nomad: `None`, with a warning.
    pub fn serve(&self, secrets_dir: &Path) -> Option<Guard> {
        use std::os::unix::fs::PermissionsExt;
        let path = secrets_dir.join("api.sock");
        let _ = std::fs::remove_file(&path);
        let listener = match tokio::net::UnixListener::bind(&path) {
            Ok(l) => l,
            Err(e) => {
                tracing::warn!(path = %path.display(), error = %e, "error creating task api socket");
                return None;
            }
        };
        let _ = std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o666));
        let app = router(self.state.clone()).layer(axum::middleware::from_fn_with_state(
            self.state.clone(),
            authenticate,
        ));
        let node_id = self.state.agent.node_id.clone().unwrap_or_default();
        let mut restarting = self.state.server.restarting.subscribe();
        let sock = path.clone();
        let task = tokio::spawn(async move {
            let mut listener = Some(listener);
            loop {
                if let Some(l) = listener.take() {
                    let mut conns = tokio::task::JoinSet::new();
                    loop {
                        tokio::select! {
                            a = l.accept() => {
                                let Ok((stream, _)) = a else { return };
                                let svc = hyper_util::service::TowerToHyperService::new(app.clone());
                                conns.spawn(async move {
                                    let _ = hyper::server::conn::http1::Builder::new()
                                        .serve_connection(TokioIo::new(stream), svc)
                                        .await;
                                });
                            }
                            Some(_) = conns.join_next(), if !conns.is_empty() => {}
                            _ = restarting.wait_for(|s| s.contains(&node_id)) => break,
                        }
                    }
                    // The client agent restarts: its listeners close (Go's unix listener
                    // unlinks the socket on close) and open requests end.
                    conns.abort_all();
                    drop(l);
                    let _ = std::fs::remove_file(&sock);
                }
                if restarting
                    .wait_for(|s| !s.contains(&node_id))
                    .await
                    .is_err()
                {
                    return;
                }
                // Back: the restored task's `apiHook.Prestart` creates the socket again.
                match tokio::net::UnixListener::bind(&sock) {
                    Ok(l) => {
                        let _ =
                            std::fs::set_permissions(&sock, std::fs::Permissions::from_mode(0o666));
                        listener = Some(l);
                    }
                    Err(e) => {
                        tracing::warn!(path = %sock.display(), error = %e, "error creating task api socket");
                        return;
                    }
                }
            }
        });
        Some(Guard { path, task })
    }
}
