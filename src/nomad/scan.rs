//! A lazy JSON scanner for Nomad's large answers: it finds keys and the ends of values by
//! matching brackets and quotes, without validating or decoding what it skips. What is
//! used is then decoded (and validated) by serde_json: the payloads of this node's events
//! ([`frame`], [`node_id_is`]) and the changed allocations of a node's list ([`list`]).
//! It never panics and never reads out of bounds on malformed input; a broken structure is
//! an error with the byte offset where it broke.

/// Calls `each(topic, type, payload)` for every event of the frame `p` (the raw bytes
/// of strings, unescaped only where they had escapes). Returns the frame's `Index`
/// (`None` for `{}` or any object without `Index` and `Events`), or the byte offset
/// where the structure broke.
pub fn frame(p: &[u8], mut each: impl FnMut(&[u8], &[u8], &[u8])) -> Result<Option<u64>, usize> {
    let mut index = None;
    let mut saw_events = false;
    let i = members(p, ws(p, 0), Commas::Optional, |key, i| match key {
        b"Index" => {
            let end = value_end(p, i)?;
            index = std::str::from_utf8(&p[i..end])
                .ok()
                .and_then(|n| n.parse().ok());
            if index.is_none() {
                return Err(i);
            }
            Ok(end)
        }
        b"Events" if p.get(i) == Some(&b'[') => {
            saw_events = true;
            events(p, i, &mut each)
        }
        _ => value_end(p, i),
    })?;
    if ws(p, i) != p.len() {
        return Err(i);
    }
    Ok(index.filter(|_| saw_events))
}

fn events(p: &[u8], i: usize, each: &mut impl FnMut(&[u8], &[u8], &[u8])) -> Result<usize, usize> {
    let mut i = i + 1;
    loop {
        i = ws(p, i);
        match p.get(i) {
            Some(b']') => return Ok(i + 1),
            Some(b'{') => {}
            _ => return Err(i),
        }
        let (mut topic, mut typ, mut payload): (&[u8], &[u8], &[u8]) = (b"", b"", b"");
        i = members(p, i, Commas::Optional, |key, i| {
            let end = value_end(p, i)?;
            match key {
                b"Topic" if p[i] == b'"' => topic = &p[i + 1..end - 1],
                b"Type" if p[i] == b'"' => typ = &p[i + 1..end - 1],
                b"Payload" => payload = &p[i..end],
                _ => {}
            }
            Ok(end)
        })?;
        if !payload.is_empty() {
            each(topic, typ, payload);
        }
        i = ws(p, i);
        if p.get(i) == Some(&b',') {
            i += 1;
        }
    }
}

/// How an object's members are separated: as the frame scanner has always read them (a
/// comma after a value is optional), or as JSON requires (a comma between members, none
/// after the last).
#[derive(Clone, Copy, PartialEq)]
enum Commas {
    Optional,
    Required,
}

/// Walks the members of the object whose `{` is at `i`: `each(key, value_start)` reads a
/// member's value and returns where it ends (the key's raw bytes, escapes left as they
/// are). Returns the index after the closing `}`, or where the structure broke.
fn members(
    p: &[u8],
    i: usize,
    commas: Commas,
    mut each: impl FnMut(&[u8], usize) -> Result<usize, usize>,
) -> Result<usize, usize> {
    let mut i = expect(p, i, b'{')?;
    let mut first = true;
    loop {
        i = ws(p, i);
        match p.get(i) {
            Some(b'}') if first || commas == Commas::Optional => return Ok(i + 1),
            Some(b'"') => {}
            _ => return Err(i),
        }
        first = false;
        let (key, after) = string(p, i)?;
        i = ws(p, expect(p, ws(p, after), b':')?);
        i = ws(p, each(key, i)?);
        match (p.get(i), commas) {
            (Some(b','), _) => i += 1,
            (Some(b'}'), Commas::Required) => return Ok(i + 1),
            (_, Commas::Optional) => {}
            _ => return Err(i),
        }
    }
}

fn expect(p: &[u8], i: usize, b: u8) -> Result<usize, usize> {
    if p.get(i) == Some(&b) {
        Ok(i + 1)
    } else {
        Err(i)
    }
}

/// The raw bytes of the string at `i` (a key: escapes left as they are; Nomad's keys
/// have none) and the index after it.
fn string(p: &[u8], i: usize) -> Result<(&[u8], usize), usize> {
    let end = string_end(p, i)?;
    Ok((&p[i + 1..end - 1], end))
}
fn ws(p: &[u8], mut i: usize) -> usize {
    while i < p.len() && matches!(p[i], b' ' | b'\n' | b'\r' | b'\t') {
        i += 1;
    }
    i
}

/// `p[i]` is `"`; returns the index after the closing quote.
fn string_end(p: &[u8], i: usize) -> Result<usize, usize> {
    let mut j = i + 1;
    loop {
        match memchr::memchr2(b'"', b'\\', p.get(j..).ok_or(i)?) {
            Some(k) if p[j + k] == b'"' => return Ok(j + k + 1),
            Some(k) => j += k + 2,
            None => return Err(i),
        }
    }
}

/// Returns the index after the value starting at `i`. Inside an object only `{`, `}`
/// and strings matter to find its end (and likewise for arrays).
fn value_end(p: &[u8], i: usize) -> Result<usize, usize> {
    let (open, close) = match p.get(i) {
        Some(b'"') => return string_end(p, i),
        Some(b'{') => (b'{', b'}'),
        Some(b'[') => (b'[', b']'),
        Some(_) => {
            let mut j = i;
            while j < p.len() && !matches!(p[j], b',' | b'}' | b']' | b' ' | b'\n' | b'\r' | b'\t')
            {
                j += 1;
            }
            return if j == i { Err(i) } else { Ok(j) };
        }
        None => return Err(i),
    };
    // A plain byte loop: Nomad's JSON has a quote every few bytes, too dense for memchr.
    let mut depth = 0usize;
    let mut j = i;
    while j < p.len() {
        let b = p[j];
        if b == b'"' {
            j += 1;
            while j < p.len() {
                match p[j] {
                    b'\\' => j += 2,
                    b'"' => break,
                    _ => j += 1,
                }
            }
        } else if b == open {
            depth += 1;
        } else if b == close {
            depth -= 1;
            if depth == 0 {
                return Ok(j + 1);
            }
        }
        j += 1;
    }
    Err(i)
}

/// Finds the value of `key` in the object starting at `i`; returns its start index.
fn find_key(p: &[u8], i: usize, key: &str) -> Option<usize> {
    let mut i = ws(p, i);
    if p.get(i) != Some(&b'{') {
        return None;
    }
    i += 1;
    loop {
        i = ws(p, i);
        if p.get(i) != Some(&b'"') {
            return None; // `}`: not found
        }
        let end = string_end(p, i).ok()?;
        let raw = &p[i + 1..end - 1];
        let matches = if raw.contains(&b'\\') {
            serde_json::from_slice::<String>(&p[i..end]).is_ok_and(|k| k == key)
        } else {
            raw == key.as_bytes()
        };
        i = ws(p, end);
        i = ws(p, i + 1); // ':'
        if matches {
            return Some(i);
        }
        i = ws(p, value_end(p, i).ok()?);
        if p.get(i) == Some(&b',') {
            i += 1;
        }
    }
}

/// True when the payload's `Allocation.NodeID` equals `node_id`: reads the payload's
/// keys up to `NodeID` only (the fifth key in Nomad's field order).
pub fn node_id_is(p: &[u8], node_id: &str) -> bool {
    let Some(a) = find_key(p, 0, "Allocation") else {
        return false;
    };
    let Some(v) = find_key(p, a, "NodeID") else {
        return false;
    };
    if p.get(v) != Some(&b'"') {
        return false; // null
    }
    let Ok(end) = string_end(p, v) else {
        return false;
    };
    let raw = &p[v + 1..end - 1];
    if raw.contains(&b'\\') {
        serde_json::from_slice::<String>(&p[v..end]).is_ok_and(|n| n == node_id)
    } else {
        raw == node_id.as_bytes()
    }
}

/// One object of a JSON array found by [`list`]: where it is, and where its top-level
/// `ID` and `ModifyIndex` values are (raw: `"…"`, a number or `null`), when it has them.
#[derive(Debug, Clone, PartialEq)]
pub struct Element {
    pub whole: std::ops::Range<usize>,
    pub id: Option<std::ops::Range<usize>>,
    pub modify_index: Option<std::ops::Range<usize>>,
}

/// The objects of the JSON array `p` (a node's allocation list), each read only as far as
/// its top-level keys: one pass over the bytes, nothing decoded or copied. Errors (the
/// byte offset where the structure broke): not an array, an element that is not an
/// object, a repeated `ID` or `ModifyIndex`, a missing `,` `:` or closing bracket, or
/// anything after the array.
pub fn list(p: &[u8]) -> Result<Vec<Element>, usize> {
    let mut i = ws(p, expect(p, ws(p, 0), b'[')?);
    let mut out = Vec::new();
    if p.get(i) == Some(&b']') {
        i += 1;
    } else {
        loop {
            i = ws(p, i);
            let start = i;
            let (mut id, mut modify_index) = (None, None);
            i = members(p, i, Commas::Required, |key, i| {
                let end = value_end(p, i)?;
                let slot = match key {
                    b"ID" => Some(&mut id),
                    b"ModifyIndex" => Some(&mut modify_index),
                    _ => None,
                };
                if let Some(slot) = slot {
                    if slot.is_some() {
                        return Err(i);
                    }
                    *slot = Some(i..end);
                }
                Ok(end)
            })?;
            out.push(Element {
                whole: start..i,
                id,
                modify_index,
            });
            i = ws(p, i);
            match p.get(i) {
                Some(b',') => i += 1,
                Some(b']') => {
                    i += 1;
                    break;
                }
                _ => return Err(i),
            }
        }
    }
    if ws(p, i) != p.len() {
        return Err(i);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn probe_reads_node_id_only() {
        let p = br#"{"Allocation":{"ID":"a","Namespace":"d","EvalID":"e\"x","Name":"j.g[0]","Metrics":{"X":[1,{"NodeID":"me"}]},"NodeID":"other","ClientStatus":"x"}}"#;
        assert!(node_id_is(p, "other"));
        assert!(!node_id_is(p, "me"));
        assert!(!node_id_is(
            br#"{"Allocation":{"ID":"a","NodeID":null}}"#,
            "me"
        ));
        assert!(!node_id_is(br#"{"Job":{"NodeID":"me"}}"#, "me"));
        assert!(node_id_is(
            br#" { "Allocation" : { "ID" : 1.5e3 , "NodeID" : "m\u0065" } } "#,
            "me"
        ));
        // A truncated payload never panics.
        assert!(!node_id_is(br#"{"Allocation":{"ID":"a"#, "me"));
    }

    fn text2<'a>(p: &'a [u8], r: &Option<std::ops::Range<usize>>) -> Option<&'a [u8]> {
        r.clone().map(|r| &p[r])
    }

    #[test]
    fn a_list_is_read_for_its_objects_ids_and_modify_indexes() {
        let p = br#" [ {"ID":"a","Job":{"ID":"j","ModifyIndex":99,"S":"}\"{"},"ModifyIndex":7} ,
            {"ModifyIndex":null,"ID":"b\u0031"}, {} ] "#;
        let l = list(p).unwrap();
        let text = |r: &Option<std::ops::Range<usize>>| r.clone().map(|r| &p[r]);
        assert_eq!(l.len(), 3);
        assert_eq!(text(&l[0].id), Some(&br#""a""#[..]));
        assert_eq!(
            text(&l[0].modify_index),
            Some(&b"7"[..]),
            "the Job's is not taken"
        );
        assert!(
            p[l[0].whole.clone()].starts_with(b"{\"ID\"") && p[l[0].whole.clone()].ends_with(b"7}")
        );
        assert_eq!(text(&l[1].id), Some(&br#""b\u0031""#[..]));
        assert_eq!(text(&l[1].modify_index), Some(&b"null"[..]));
        assert_eq!((l[2].id.clone(), l[2].modify_index.clone()), (None, None));
        assert_eq!(list(b"[]"), Ok(vec![]));
        // A string ending in an escaped backslash ends at its quote.
        let p = br#"[{"ID":"a\\","X":"\"}","ModifyIndex":1}]"#;
        let l = list(p).unwrap();
        assert_eq!(text2(p, &l[0].id), Some(&br#""a\\""#[..]));
        assert_eq!(text2(p, &l[0].modify_index), Some(&b"1"[..]));
        // Broken structures are errors, never a shorter list, and never a panic.
        for bad in [
            &b""[..],
            b"{}",
            b"[1]",
            b"[{}",
            b"[{} {}]",
            b"[{}],",
            br#"[{"ID":"a" "X":1}]"#,
            br#"[{"ID":"a","ID":"b"}]"#,
            br#"[{"ID" 1}]"#,
            br#"[{"ID":"a}]"#,
            br#"[{"ID":{"x":1}]"#,
            b"[{}]x",
        ] {
            assert!(list(bad).is_err(), "{}", String::from_utf8_lossy(bad));
        }
        let whole = br#"[{"ID":"a","ModifyIndex":7,"Job":{"TaskGroups":[{"Name":"g"}]}}]"#;
        for cut in 0..whole.len() {
            assert!(list(&whole[..cut]).is_err(), "cut at {cut}");
        }
    }
}
