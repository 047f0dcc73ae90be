//! Pulls against a local fake hub: verification, parallel ranges, dropped connections,
//! resume, damaged partials, split sets, and one clear error per failure.

use gguf::{GgmlType, GgufModel, GgufWriter, Value};
use sha2::{Digest as _, Sha256};
use std::ops::ControlFlow;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Duration;
use store::fake_hub::FakeHub;
use store::{DownloadOptions, Hub, HubConfig, PullObserver, PullRequest, Quiet, Store, StoreError, Want};

/// Deterministic bytes (xorshift64), so a failure can be replayed.
fn bytes(n: usize, seed: u64) -> Vec<u8> {
    let mut x = seed | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 24) as u8
        })
        .collect()
}

fn sha256(b: &[u8]) -> Vec<u8> {
    Sha256::digest(b).to_vec()
}

fn hub_client(hub: &FakeHub, token: Option<&str>) -> Hub {
    Hub::new(HubConfig {
        endpoint: hub.url(),
        token: token.map(str::to_string),
        connect_timeout: Duration::from_secs(5),
        idle_timeout: Duration::from_secs(10),
    })
    .unwrap()
}

fn opts(chunk_bytes: u64) -> DownloadOptions {
    DownloadOptions { connections: 4, chunk_bytes, max_attempts: 4, retry_backoff: Duration::from_millis(20) }
}

fn req(repo: &str, want: Option<&str>) -> PullRequest {
    PullRequest { repo: repo.into(), want: Want::parse(want), revision: "main".into() }
}

#[test]
fn pull_by_quant_verifies_with_parallel_ranges_and_pages_the_listing() {
    let hub = FakeHub::start();
    let data = bytes(3 << 20, 1);
    hub.add_file("org/model-GGUF", "model-Q4_K_M.gguf", data.clone(), true);
    hub.add_file("org/model-GGUF", "model-Q8_0.gguf", bytes(1000, 2), true);
    hub.add_file("org/model-GGUF", "README.md", b"# hi\n".to_vec(), false);
    hub.set_page_size(Some(1));
    // Slow enough that the four connections overlap.
    hub.set_throttle(Some(8 << 20));
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(dir.path());
    let out =
        store.pull(&hub_client(&hub, None), &req("org/model-GGUF", Some("q4_k_m")), &opts(256 << 10), &Quiet).unwrap();
    assert_eq!(out.name, "org/model-GGUF:Q4_K_M");
    assert_eq!(out.n_downloaded, 1);
    let got = std::fs::read(&out.files[0]).unwrap();
    assert_eq!(sha256(&got), sha256(&data));
    let st = hub.stats();
    assert_eq!(st.ranged_gets, 12, "3 MiB in 256 KiB chunks: {st:?}");
    assert!(st.max_concurrent_bodies >= 2, "ranges were not fetched in parallel: {st:?}");
    assert!(!store::partial_path(&out.files[0]).exists());
    assert!(!store::journal_path(&out.files[0]).exists());

    // Pulling again fetches nothing: the file is recorded as verified.
    let again =
        store.pull(&hub_client(&hub, None), &req("org/model-GGUF:Q4_K_M", None), &opts(256 << 10), &Quiet).unwrap();
    assert_eq!(again.n_downloaded, 0);
    assert_eq!(hub.stats().content_gets, st.content_gets);
}

#[test]
fn dropped_connections_resume_inside_the_chunk() {
    let hub = FakeHub::start();
    let data = bytes(2 << 20, 3);
    hub.add_file("o/r", "m-Q8_0.gguf", data.clone(), true);
    hub.drop_connections(100_000, 6);
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(dir.path());
    let retries = AtomicU64::new(0);
    struct CountRetries<'a>(&'a AtomicU64);
    impl PullObserver for CountRetries<'_> {
        fn retrying(&self, _: &str, _: u32, _: &str, _: Duration) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }
    let out = store.pull(&hub_client(&hub, None), &req("o/r", None), &opts(1 << 20), &CountRetries(&retries)).unwrap();
    assert_eq!(sha256(&std::fs::read(&out.files[0]).unwrap()), sha256(&data));
    let st = hub.stats();
    assert_eq!(st.drops, 6);
    assert_eq!(retries.load(Ordering::SeqCst), 6);
    // Each retry asked only for the rest of its chunk: nothing was sent twice.
    assert_eq!(st.content_bytes_sent, data.len() as u64, "{st:?}");
}

/// Stops the pull once `limit` bytes have arrived, as a kill would (minus the journal's
/// guarantees being tested separately with SIGKILL in the cli's tests).
struct StopAfter {
    limit: u64,
    seen: AtomicU64,
    corrupted: Mutex<Vec<usize>>,
}

impl PullObserver for StopAfter {
    fn bytes_downloaded(&self, n: u64) -> ControlFlow<()> {
        if self.seen.fetch_add(n, Ordering::SeqCst) + n >= self.limit {
            ControlFlow::Break(())
        } else {
            ControlFlow::Continue(())
        }
    }
    fn chunk_corrupted(&self, _: &str, chunk_index: usize, _: u64, _: u64) {
        self.corrupted.lock().unwrap().push(chunk_index);
    }
}

fn stop_after(limit: u64) -> StopAfter {
    StopAfter { limit, seen: AtomicU64::new(0), corrupted: Mutex::new(Vec::new()) }
}

/// Chunk indices the journal records as complete.
fn journaled(dest: &Path) -> Vec<usize> {
    let text = std::fs::read_to_string(store::journal_path(dest)).unwrap();
    let mut v: Vec<usize> = text.lines().skip(1).filter_map(|l| l.split(' ').next()?.parse().ok()).collect();
    v.sort();
    v.dedup();
    v
}

#[test]
fn interrupted_pull_resumes_and_a_damaged_partial_is_refetched() {
    let hub = FakeHub::start();
    let data = bytes(4 << 20, 4);
    hub.add_file("o/r", "m-Q8_0.gguf", data.clone(), true);
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(dir.path());
    let chunk = 256u64 << 10;
    let first = stop_after(2 << 20);
    let err = store.pull(&hub_client(&hub, None), &req("o/r", Some("Q8_0")), &opts(chunk), &first).unwrap_err();
    assert!(matches!(err, StoreError::Cancelled), "{err}");
    let dest = dir.path().join("hub/o/r/m-Q8_0.gguf");
    assert!(!dest.exists(), "an unverified file has its final name");
    let done = journaled(&dest);
    assert!(done.len() >= 4, "journal: {done:?}");

    // Damage one journaled chunk on disk, as a bad sector or a stray write would.
    let victim = done[done.len() / 2];
    let partial = store::partial_path(&dest);
    let mut p = std::fs::read(&partial).unwrap();
    p[victim * chunk as usize + 1234] ^= 0x55;
    std::fs::write(&partial, &p).unwrap();

    let sent_before = hub.stats().content_bytes_sent;
    let second = stop_after(u64::MAX);
    let out = store.pull(&hub_client(&hub, None), &req("o/r", Some("Q8_0")), &opts(chunk), &second).unwrap();
    assert_eq!(sha256(&std::fs::read(&out.files[0]).unwrap()), sha256(&data));
    assert_eq!(*second.corrupted.lock().unwrap(), vec![victim]);
    // The resume fetched the missing chunks and the damaged one, not what was already there.
    let resent = hub.stats().content_bytes_sent - sent_before;
    let missing = data.len() as u64 - done.len() as u64 * chunk;
    assert_eq!(resent, missing + chunk, "resent {resent}, missing {missing}");
}

#[test]
fn checksum_mismatch_leaves_no_file_under_the_final_name() {
    let hub = FakeHub::start();
    let data = bytes(600_000, 5);
    hub.add_file("o/r", "m-Q8_0.gguf", data, true);
    hub.publish_wrong_sha256("o/r", "m-Q8_0.gguf", &"ab".repeat(32));
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(dir.path());
    let err = store.pull(&hub_client(&hub, None), &req("o/r", None), &opts(100_000), &Quiet).unwrap_err();
    let msg = err.to_string();
    assert!(matches!(err, StoreError::ChecksumMismatch { .. }), "{msg}");
    assert!(msg.contains(&"ab".repeat(32)) && msg.contains("m-Q8_0.gguf"), "{msg}");
    let dest = dir.path().join("hub/o/r/m-Q8_0.gguf");
    assert!(!dest.exists() && !store::partial_path(&dest).exists() && !store::journal_path(&dest).exists());
    assert!(store.list().models.is_empty());
}

#[test]
fn each_failure_is_one_clear_error() {
    let hub = FakeHub::start();
    hub.add_file("o/r", "m-Q8_0.gguf", bytes(1000, 6), true);
    hub.add_file("o/private", "p-Q8_0.gguf", bytes(1000, 7), true);
    hub.make_private("o/private", "secret");
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(dir.path());
    let pull = |repo: &str, want: Option<&str>, token: Option<&str>| {
        store.pull(&hub_client(&hub, token), &req(repo, want), &opts(1 << 20), &Quiet)
    };

    let e = pull("o/missing", None, None).unwrap_err();
    assert!(matches!(e, StoreError::NotFound { .. }) && e.to_string().contains("o/missing"), "{e}");
    let e = pull("o/r", Some("nope.gguf"), None).unwrap_err();
    assert!(matches!(e, StoreError::NotFound { .. }) && e.to_string().contains("nope.gguf"), "{e}");
    let e = pull("o/r", Some("Q2_K"), None).unwrap_err();
    assert!(matches!(&e, StoreError::NoMatchingQuant { available, .. } if available == &["Q8_0"]), "{e}");
    let e = pull("o/private", None, None).unwrap_err();
    assert!(matches!(e, StoreError::Unauthorized { status: 401, .. }) && e.to_string().contains("HF_TOKEN"), "{e}");
    let e = pull("o/private", None, Some("wrong")).unwrap_err();
    assert!(matches!(e, StoreError::Unauthorized { status: 403, .. }), "{e}");
    pull("o/private", None, Some("secret")).unwrap();

    // Nothing listens on a port just released.
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let offline = Hub::new(HubConfig { endpoint: format!("http://127.0.0.1:{port}"), ..HubConfig::new() }).unwrap();
    let e = store.pull(&offline, &req("o/r", None), &opts(1 << 20), &Quiet).unwrap_err();
    assert!(matches!(e, StoreError::NoNetwork { .. }) && e.to_string().contains("HF_ENDPOINT"), "{e}");

    // More than the disk holds: refused before the first byte, with the numbers.
    hub.publish_size("o/r", "m-Q8_0.gguf", 1 << 60);
    let e = pull("o/r", None, None).unwrap_err();
    assert!(matches!(e, StoreError::DiskFull { need_bytes, .. } if need_bytes == 1 << 60), "{e}");
    assert_eq!(hub.stats().content_gets, 1, "only the private pull fetched content");

    // A server without Range support: said so, partial kept for a better server.
    hub.publish_size("o/r", "m-Q8_0.gguf", 1000);
    hub.set_ignore_range(true);
    let e = pull("o/r", None, None).unwrap_err();
    assert!(matches!(e, StoreError::RangeNotSupported { .. }), "{e}");
}

#[test]
fn plain_git_files_verify_against_the_git_blob_id() {
    let hub = FakeHub::start();
    let data = bytes(5000, 8);
    hub.add_file("o/r", "tiny-F16.gguf", data.clone(), false);
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(dir.path());
    let out = store.pull(&hub_client(&hub, None), &req("o/r", Some("tiny-F16.gguf")), &opts(1000), &Quiet).unwrap();
    assert_eq!(std::fs::read(&out.files[0]).unwrap(), data);
    let rec = std::fs::read_to_string(store::verified_path(&out.files[0])).unwrap();
    assert!(rec.starts_with("git-sha1 "), "{rec}");
}

/// (name, bytes) pairs: files, or tensors.
type Named = Vec<(String, Vec<u8>)>;

/// A 3-part split set as llama.cpp's gguf-split writes it, plus the tensor bytes per name.
fn split_set(prefix: &str) -> (Named, Named) {
    let n_parts = 3u16;
    let mut files = Vec::new();
    let mut tensors = Vec::new();
    for no in 0..n_parts {
        let mut w = GgufWriter::new();
        w.set("general.architecture", Value::String("llama".into()));
        w.set("general.file_type", Value::U32(7));
        w.set("split.no", Value::U16(no));
        w.set("split.count", Value::U16(n_parts));
        w.set("split.tensors.count", Value::I32(2 * n_parts as i32));
        let mut data = Vec::new();
        for t in 0..2 {
            let name = format!("blk.{}.ffn_down.weight", 2 * no + t);
            w.add_tensor(&name, GgmlType::Q8_0, &[64, 8]).unwrap();
            let b = bytes(2 * 34 * 8, (no * 2 + t) as u64 + 100);
            data.push((name, b));
        }
        let mut out = Vec::new();
        let mut sink = w.start(&mut out).unwrap();
        for (_, b) in &data {
            sink.write_data(b).unwrap();
        }
        sink.finish().unwrap();
        files.push((format!("{prefix}-{:05}-of-{n_parts:05}.gguf", no + 1), out));
        tensors.extend(data);
    }
    (files, tensors)
}

#[test]
fn split_set_is_pulled_whole_listed_resolved_and_removed() {
    let hub = FakeHub::start();
    let (parts, tensors) = split_set("Q8_0/Tiny-Q8_0");
    for (p, b) in &parts {
        hub.add_file("o/tiny-GGUF", p, b.clone(), true);
    }
    hub.add_file("o/tiny-GGUF", "Tiny-Q4_0.gguf", bytes(999, 9), true);
    hub.add_file("o/tiny-GGUF", "mmproj-Q8_0.gguf", bytes(99, 10), true);
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(dir.path());
    let out = store.pull(&hub_client(&hub, None), &req("o/tiny-GGUF", Some("Q8_0")), &opts(300), &Quiet).unwrap();
    assert_eq!(out.name, "o/tiny-GGUF:Q8_0");
    assert_eq!(out.files.len(), 3);
    for ((_, want), got) in parts.iter().zip(&out.files) {
        assert_eq!(&std::fs::read(got).unwrap(), want);
    }

    let model = GgufModel::open(&out.files[0]).unwrap();
    assert_eq!(model.files().len(), 3);
    assert_eq!(model.n_tensors(), tensors.len());
    for (name, b) in &tensors {
        assert_eq!(model.tensor(name).unwrap().data, &b[..], "{name}");
    }
    drop(model);

    let listing = store.list();
    assert!(listing.problems.is_empty(), "{:?}", listing.problems);
    let m = &listing.models[0];
    assert_eq!(
        (m.name.as_str(), m.architecture.as_deref(), m.quant.as_deref()),
        ("o/tiny-GGUF:Q8_0", Some("llama"), Some("Q8_0"))
    );
    assert_eq!(m.size_bytes, parts.iter().map(|(_, b)| b.len() as u64).sum::<u64>());

    for name in ["o/tiny-GGUF:Q8_0", "o/tiny-GGUF", "tiny-GGUF:Q8_0", "tiny-GGUF"] {
        assert_eq!(store::resolve_model(name, Some(dir.path())).unwrap(), out.files[0], "{name}");
    }
    let e = store::resolve_model("o/other", Some(dir.path())).unwrap_err();
    assert!(e.to_string().contains("o/tiny-GGUF:Q8_0"), "{e}");

    let removed = store.remove("o/tiny-GGUF:Q8_0").unwrap();
    assert_eq!(removed.deleted.len(), 3);
    assert!(out.files.iter().all(|f| !f.exists()));
    assert!(!dir.path().join("hub").exists(), "empty folders are left behind");
    assert!(store.list().models.is_empty());
}

#[test]
fn local_files_are_added_by_copy_or_reference_and_a_broken_one_is_reported_last() {
    let (parts, _) = split_set("Local-Q8_0");
    let src = tempfile::tempdir().unwrap();
    for (p, b) in &parts {
        std::fs::write(src.path().join(p), b).unwrap();
    }
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(dir.path());
    let second = src.path().join(&parts[1].0);
    let copied = store.add_local(&second, Some("copied"), store::AddMode::Copy).unwrap();
    assert_eq!(copied.files.len(), 3);
    let referenced = store.add_local(&second, None, store::AddMode::Reference).unwrap();
    assert_eq!(referenced.name, "Local-Q8_0");
    assert!(matches!(
        store.add_local(&second, Some("copied"), store::AddMode::Copy),
        Err(StoreError::NameTaken { .. })
    ));
    let garbage = src.path().join("garbage.gguf");
    std::fs::write(&garbage, b"not a gguf at all").unwrap();
    assert!(matches!(store.add_local(&garbage, None, store::AddMode::Copy), Err(StoreError::NotGguf { .. })));

    // Damage the referenced set: the list still shows the copy, and names the broken one.
    std::fs::write(src.path().join(&parts[2].0), b"truncated").unwrap();
    let listing = store.list();
    assert_eq!(listing.models.iter().map(|m| m.name.as_str()).collect::<Vec<_>>(), vec!["copied"]);
    assert_eq!(listing.problems.len(), 1);
    assert_eq!(listing.problems[0].0, "Local-Q8_0");
    // Removing a reference leaves the user's files alone.
    store.remove("Local-Q8_0").unwrap();
    assert!(src.path().join(&parts[0].0).exists());
}

#[test]
fn a_connection_that_keeps_dropping_stops_with_the_partial_kept_then_resumes() {
    let hub = FakeHub::start();
    let data = bytes(1 << 20, 11);
    hub.add_file("o/r", "m-Q8_0.gguf", data.clone(), true);
    // Every body is cut before its first byte: no progress, so the attempts run out.
    hub.drop_connections(0, 1000);
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(dir.path());
    let e = store.pull(&hub_client(&hub, None), &req("o/r", None), &opts(256 << 10), &Quiet).unwrap_err();
    let msg = e.to_string();
    assert!(matches!(e, StoreError::Interrupted { attempts: 4, .. }), "{msg}");
    assert!(msg.contains("run the same command again to resume"), "{msg}");
    let dest = dir.path().join("hub/o/r/m-Q8_0.gguf");
    assert!(store::partial_path(&dest).exists() && !dest.exists());

    hub.drop_connections(0, 0);
    let out = store.pull(&hub_client(&hub, None), &req("o/r", None), &opts(256 << 10), &Quiet).unwrap();
    assert_eq!(sha256(&std::fs::read(&out.files[0]).unwrap()), sha256(&data));
}
