//! A WebDAV server on 127.0.0.1 (`rclone serve webdav`), standing for network storage that
//! the reference FUSE plugin `webdav` mounts. Stopped on drop.

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A running server; `dir` holds its files.
pub struct WebdavServer {
    child: Child,
    pub url: String,
    pub dir: PathBuf,
    pub user: String,
    pub password: String,
}

impl WebdavServer {
    /// Serves `dir` on a free loopback port with basic auth `user`/`password`.
    pub fn start(dir: &Path, user: &str, password: &str) -> WebdavServer {
        let rclone = Path::new("/usr/bin/rclone");
        assert!(
            rclone.is_file(),
            "rclone is missing: scripts/install-deps installs it (Debian package rclone)"
        );
        std::fs::create_dir_all(dir).unwrap();
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let addr = format!("127.0.0.1:{port}");
        let child = Self::spawn(dir, &addr, user, password);
        let server = WebdavServer {
            child,
            url: format!("http://{addr}/"),
            dir: dir.to_path_buf(),
            user: user.into(),
            password: password.into(),
        };
        server.wait_listening();
        server
    }

    fn spawn(dir: &Path, addr: &str, user: &str, password: &str) -> Child {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(dir.with_extension("log"))
            .unwrap();
        Command::new("/usr/bin/rclone")
            .args(["serve", "webdav"])
            .arg(dir)
            .args(["--addr", addr, "--user", user, "--pass", password])
            .env_clear()
            .env("RCLONE_CONFIG", dir.with_extension("conf"))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("start rclone serve webdav")
    }

    fn addr(&self) -> String {
        self.url
            .trim_start_matches("http://")
            .trim_end_matches('/')
            .to_string()
    }

    fn wait_listening(&self) {
        let addr = self.addr();
        let deadline = Instant::now() + Duration::from_secs(20);
        while std::net::TcpStream::connect(&addr).is_err() {
            assert!(
                Instant::now() < deadline,
                "the WebDAV server did not listen on {addr}"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Kills the server, as a storage server that went down: connections to its address
    /// are refused until [`WebdavServer::restart`].
    pub fn stop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Serves the same directory again on the same address.
    pub fn restart(&mut self) {
        self.stop();
        self.child = Self::spawn(&self.dir, &self.addr(), &self.user, &self.password);
        self.wait_listening();
    }
}

impl Drop for WebdavServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The PIDs of `rclone mount` processes serving `target` (found in /proc).
pub fn mount_pids(target: &Path) -> Vec<i32> {
    let want = target.to_string_lossy().to_string();
    std::fs::read_dir("/proc")
        .unwrap()
        .filter_map(|e| e.ok())
        .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
        .filter(|pid| {
            std::fs::read(format!("/proc/{pid}/cmdline")).is_ok_and(|c| {
                let args: Vec<String> = c
                    .split(|b| *b == 0)
                    .map(|a| String::from_utf8_lossy(a).into_owned())
                    .collect();
                args.iter().any(|a| a.ends_with("rclone"))
                    && args.iter().any(|a| a == "mount")
                    && args.contains(&want)
            })
        })
        .collect()
}
