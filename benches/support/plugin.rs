//! The scale bench's volume plugin (benches/scale.rs), in the standard library alone so that
//! the bench can build it by itself into a small static binary (`rustc -C
//! target-feature=+crt-static`): its exec costs what a lean plugin's does (about 0.7 ms on
//! the bench's 2-core VM, against 1.1 ms for the bench's own 6.5 MB dynamically linked
//! binary, which `BENCH_PLUGIN=bench-binary` runs instead, by this same code).
//!
//! Started with `DHV_OPERATION` set (as the agent's runner does), it answers `fingerprint`
//! with `deferred_bind`, bind-mounts `<DHV_VOLUMES_DIR>/store/<DHV_VOLUME_ID>` on
//! `DHV_TARGET_PATH` for `publish`, unmounts the target for `unpublish`, stretches either to
//! the microseconds in `<node>/plugin.conf` (`"<publish_us> <unpublish_us>"`, 200 each by
//! default), and appends `op start_ns end_ns volume alloc` to `<node>/calls.log`, where
//! `<node>` is the directory above the plugin directory. Any other operation prints `{}`.

use std::ffi::{c_char, c_int, c_ulong, c_void, CString};
use std::io::Write;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

extern "C" {
    /// mount(2), from the C library the standard library links.
    fn mount(
        source: *const c_char,
        target: *const c_char,
        fstype: *const c_char,
        flags: c_ulong,
        data: *const c_void,
    ) -> c_int;
    /// umount2(2).
    fn umount2(target: *const c_char, flags: c_int) -> c_int;
}

/// `MS_BIND` of <sys/mount.h>.
const MS_BIND: c_ulong = 4096;

fn c_path(p: &Path) -> std::io::Result<CString> {
    CString::new(p.as_os_str().as_bytes())
        .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e))
}

fn bind_mount(src: &Path, target: &Path) -> std::io::Result<()> {
    let (s, t) = (c_path(src)?, c_path(target)?);
    // SAFETY: both strings are NUL-terminated and outlive the call; a null file system type
    // and data are what mount(2) takes for MS_BIND.
    let rc = unsafe {
        mount(
            s.as_ptr(),
            t.as_ptr(),
            std::ptr::null(),
            MS_BIND,
            std::ptr::null(),
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

fn unmount(target: &Path) -> bool {
    let Ok(t) = c_path(target) else {
        return false;
    };
    // SAFETY: `t` is NUL-terminated and outlives the call.
    unsafe { umount2(t.as_ptr(), 0) == 0 }
}

/// Unix time in ns (the bench lines the calls up with its own clock readings).
pub fn now_ns() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0)
}

fn env(k: &str) -> String {
    std::env::var(k).unwrap_or_default()
}

/// A JSON string literal of `s` (the paths and messages the plugin prints).
fn json_str(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    for ch in s.chars() {
        match ch {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

/// Stretches the call to `us` microseconds after `start_ns`.
fn stretch(start_ns: u64, us: u64) {
    let end = start_ns + us * 1000;
    let now = now_ns();
    if end > now {
        std::thread::sleep(Duration::from_nanos(end - now));
    }
}

pub fn main() {
    let start = now_ns();
    let op = env("DHV_OPERATION");
    // <node>/plugins/bench → <node>
    let node = std::env::current_exe()
        .ok()
        .and_then(|p| p.parent()?.parent().map(PathBuf::from))
        .unwrap_or_default();
    let conf = std::fs::read_to_string(node.join("plugin.conf")).unwrap_or_default();
    let us: Vec<u64> = conf
        .split_whitespace()
        .filter_map(|v| v.parse().ok())
        .collect();
    let (publish_us, unpublish_us) = (
        us.first().copied().unwrap_or(200),
        us.get(1).copied().unwrap_or(200),
    );
    let target = PathBuf::from(env("DHV_TARGET_PATH"));
    let out = match op.as_str() {
        "fingerprint" => r#"{"version":"1.0.0","deferred_bind":true}"#.to_string(),
        "publish" => {
            let src = PathBuf::from(env("DHV_VOLUMES_DIR"))
                .join("store")
                .join(env("DHV_VOLUME_ID"));
            let made = std::fs::create_dir_all(&src)
                .and_then(|_| std::fs::create_dir_all(&target))
                .and_then(|_| bind_mount(&src, &target));
            if let Err(e) = made {
                println!("{{\"error\":{}}}", json_str(&e.to_string()));
                std::process::exit(1);
            }
            stretch(start, publish_us);
            format!(
                "{{\"path\":{},\"context\":{{}}}}",
                json_str(&target.to_string_lossy())
            )
        }
        "unpublish" => {
            while unmount(&target) {}
            stretch(start, unpublish_us);
            "{}".to_string()
        }
        _ => "{}".to_string(),
    };
    let end = now_ns();
    if let Ok(mut f) = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(node.join("calls.log"))
    {
        let _ = f.write_all(
            format!(
                "{op} {start} {end} {} {}\n",
                env("DHV_VOLUME_NAME"),
                env("DHV_ALLOC_ID")
            )
            .as_bytes(),
        );
    }
    println!("{out}");
}
