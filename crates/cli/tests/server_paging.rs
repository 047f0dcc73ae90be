//! `diskformer serve`'s pager flags end to end: `--ram-budget` on the command line with
//! `--models-preset` adding a per-model policy and `stats`, on the qwen3_moe fixture with a
//! budget of one expert (a token routes to two, so every layer evicts). Checked: the completion
//! is served, `/metrics` counts the model's expert cache, unloading prints the `--stats` table,
//! and a bad presets file stops the server at start with the line at fault.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn moe_fixture() -> PathBuf {
    let full = repo().join("../shared/fixtures/qwen3_moe/model-q4_0.gguf");
    if full.exists() {
        eprintln!("fixtures: full set ({})", full.display());
        full
    } else {
        eprintln!("fixtures: compact subset (tests/fixtures)");
        repo().join("tests/fixtures/qwen3_moe/model-q4_0.gguf")
    }
}

fn request(addr: SocketAddr, method: &str, path: &str, body: &str) -> (u16, String) {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(120))).unwrap();
    let req = format!(
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes()).unwrap();
    let mut raw = String::new();
    s.read_to_string(&mut raw).unwrap();
    let (head, rest) = raw.split_once("\r\n\r\n").expect("a response head");
    (head.split_whitespace().nth(1).unwrap().parse().unwrap(), rest.to_string())
}

fn serve(dir: &Path, extra: &[&str]) -> (Child, PathBuf) {
    let stderr_path = dir.join("stderr.log");
    let child = Command::new(env!("CARGO_BIN_EXE_diskformer"))
        .arg("serve")
        .args(["--models-dir"])
        .arg(dir.join("models"))
        .args(["--port", "0", "--device", "cpu", "--no-read-ahead", "-c", "128", "--threads", "2"])
        .args(extra)
        .stdout(Stdio::piped())
        .stderr(std::fs::File::create(&stderr_path).unwrap())
        .spawn()
        .expect("starting diskformer serve");
    (child, stderr_path)
}

fn models_dir() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir(dir.path().join("models")).unwrap();
    std::fs::copy(moe_fixture(), dir.path().join("models/moe.gguf")).unwrap();
    dir
}

#[test]
fn serve_pages_experts_with_the_budget_policy_and_stats_asked_for() {
    let dir = models_dir();
    let file = Arc::new(gguf::GgufModel::open(dir.path().join("models/moe.gguf")).unwrap());
    let budget = pager::Pager::budget_for_slots(&file, 1).unwrap();
    let preset = dir.path().join("presets.ini");
    std::fs::write(&preset, "[moe]\ncache-policy = lru\nstats = true\n").unwrap();
    let (mut child, stderr_path) =
        serve(dir.path(), &["--ram-budget", &budget.to_string(), "--models-preset", preset.to_str().unwrap()]);
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let addr: SocketAddr = loop {
        match lines.next() {
            Some(Ok(l)) => {
                if let Some(a) = l.strip_prefix("listening on http://") {
                    break a.trim().parse().unwrap();
                }
            }
            _ => panic!("the server exited: {}", std::fs::read_to_string(&stderr_path).unwrap_or_default()),
        }
    };
    std::thread::spawn(move || for _ in lines {});
    let (status, body) = request(
        addr,
        "POST",
        "/v1/completions",
        r#"{"model": "moe", "prompt": "The quick brown fox", "max_tokens": 8, "temperature": 0}"#,
    );
    assert_eq!(status, 200, "{body}");
    let (_, models) = request(addr, "GET", "/models", "");
    assert!(models.contains(&format!("\"budget_bytes\":{budget}")), "{models}");
    assert!(models.contains("\"policy\":\"lru\""), "{models}");
    let (_, metrics) = request(addr, "GET", "/metrics", "");
    let misses: u64 = metrics
        .lines()
        .find_map(|l| l.strip_prefix("diskformer_expert_cache_misses_total{model=\"moe\"} "))
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no expert-cache misses for moe:\n{metrics}"));
    assert!(misses > 0, "{metrics}");
    // The finished request's relay thread lets go of the model just after the answer is sent.
    let t0 = std::time::Instant::now();
    loop {
        let (status, body) = request(addr, "POST", "/models/moe/unload", "");
        assert_eq!(status, 200, "{body}");
        if body.contains("true") {
            break;
        }
        assert!(t0.elapsed() < Duration::from_secs(30), "the idle model was never unloaded: {body}");
        std::thread::sleep(Duration::from_millis(50));
    }
    // The --stats table is printed as the model is dropped, on a blocking thread.
    let t0 = std::time::Instant::now();
    let err = loop {
        let err = std::fs::read_to_string(&stderr_path).unwrap_or_default();
        if err.contains("model moe: expert cache: 1 slots") || t0.elapsed() > Duration::from_secs(30) {
            break err;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let _ = child.kill();
    let _ = child.wait();
    assert!(err.contains("model moe: expert cache: 1 slots"), "no --stats table on unload:\n{err}");
    assert!(err.contains("Lru"), "{err}");
    assert!(!err.contains("panicked"), "{err}");
}

#[test]
fn a_bad_presets_line_stops_serve_at_start() {
    let dir = models_dir();
    let preset = dir.path().join("presets.ini");
    std::fs::write(&preset, "[moe]\nram-budjet = 8G\n").unwrap();
    let (child, stderr_path) = serve(dir.path(), &["--models-preset", preset.to_str().unwrap()]);
    let out = child.wait_with_output().unwrap();
    assert!(!out.status.success());
    let err = std::fs::read_to_string(&stderr_path).unwrap();
    assert!(err.contains("presets line 2: `ram-budjet` is not a per-model option"), "{err}");
}
