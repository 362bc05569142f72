//! Helpers the data-parallel tests share (each test crate uses some of them).
#![allow(dead_code)]

use std::path::Path;

use serde_json::{Map, Value};

/// Metrics lines without what depends on the wall clock (`time/…`, `perf/…`).
pub fn deterministic(lines: Vec<Map<String, Value>>) -> Vec<Map<String, Value>> {
    lines
        .into_iter()
        .map(|l| {
            l.into_iter()
                .filter(|(k, _)| !k.starts_with("time/") && !k.starts_with("perf/"))
                .collect()
        })
        .collect()
}

/// Every file under a checkpoint `dir` but its config (a resumed run's says so), by path
/// inside it, with its bytes.
pub fn checkpoint_files(dir: &Path) -> Vec<(String, Vec<u8>)> {
    fn walk(root: &Path, dir: &Path, out: &mut Vec<(String, Vec<u8>)>) {
        for e in std::fs::read_dir(dir).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                walk(root, &p, out);
            } else {
                let name = p.strip_prefix(root).unwrap().display().to_string();
                if name != "config.yaml" {
                    out.push((name, std::fs::read(&p).unwrap()));
                }
            }
        }
    }
    let mut out = Vec::new();
    walk(dir, dir, &mut out);
    out.sort();
    out
}

/// Asserts two checkpoints' files are the same names and bytes (`what` says which runs).
pub fn assert_same_files(got: &[(String, Vec<u8>)], want: &[(String, Vec<u8>)], what: &str) {
    let names = |f: &[(String, Vec<u8>)]| f.iter().map(|x| x.0.clone()).collect::<Vec<_>>();
    assert_eq!(names(got), names(want), "{what}: files");
    for ((n, b), (_, w)) in got.iter().zip(want) {
        assert!(b == w, "{what}: {n} differs");
    }
}

/// A free TCP port on this machine (for a launched run's `MASTER_PORT`).
pub fn free_port() -> String {
    std::net::TcpListener::bind(("127.0.0.1", 0))
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
        .to_string()
}
