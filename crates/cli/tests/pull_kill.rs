//! `diskformer pull` killed with SIGKILL at random moments and run again: the final file is
//! byte-identical every time, a damaged partial is caught and re-fetched, a split set arrives
//! whole and opens, and failures print one clear line. The hub is a local fake
//! (`store::fake_hub`) reached through `HF_ENDPOINT`.

use sha2::{Digest as _, Sha256};
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};
use store::fake_hub::FakeHub;

const BIN: &str = env!("CARGO_BIN_EXE_diskformer");

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

fn sha256(b: &[u8]) -> String {
    Sha256::digest(b).iter().map(|b| format!("{b:02x}")).collect()
}

fn pull_cmd(hub: &FakeHub, store: &Path, args: &[&str]) -> Command {
    let mut c = Command::new(BIN);
    c.arg("pull")
        .args(args)
        .arg("--store")
        .arg(store)
        .args(["--chunk-kib", "128", "--connections", "4", "--quiet"])
        .env("HF_ENDPOINT", hub.url())
        .env_remove("HF_TOKEN")
        .env_remove("DISKFORMER_STORE")
        .env("HF_HOME", store.join("no-hf-home"))
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    c
}

fn run(mut c: Command) -> Output {
    c.output().expect("run diskformer")
}

/// Starts a pull and SIGKILLs it after `after`; returns whether it had already exited.
fn pull_and_kill(hub: &FakeHub, store: &Path, args: &[&str], after: Duration) -> bool {
    let mut child = pull_cmd(hub, store, args).stdout(Stdio::null()).stderr(Stdio::null()).spawn().expect("spawn");
    let start = Instant::now();
    while start.elapsed() < after {
        if child.try_wait().expect("wait").is_some() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    // Child::kill sends SIGKILL on Unix: no destructor, no flush, no cleanup runs.
    child.kill().expect("kill");
    child.wait().expect("reap");
    false
}

/// A small xorshift generator; the seed is printed so a failing run can be replayed.
struct Rng(u64);
impl Rng {
    fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % n
    }
}

fn seed() -> u64 {
    let s = std::env::var("PULL_KILL_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or_else(|| {
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos() as u64).unwrap_or(1)
    });
    println!("PULL_KILL_SEED={s}");
    s | 1
}

/// Checks what a kill left: every chunk the journal records is in the partial, with the
/// journaled digest and the right bytes. Returns how many chunks were recorded.
fn check_journal(dest: &Path, data: &[u8], chunk_bytes: usize) -> usize {
    let Ok(text) = std::fs::read_to_string(store::journal_path(dest)) else { return 0 };
    let Ok(partial) = std::fs::read(store::partial_path(dest)) else { return 0 };
    let mut n = 0;
    // Only whole lines count; a kill can tear the last one.
    for line in text.split_inclusive('\n').skip(1).filter(|l| l.ends_with('\n')) {
        let (i, h) = line.trim_end().split_once(' ').unwrap();
        let i: usize = i.parse().unwrap();
        let range = i * chunk_bytes..((i + 1) * chunk_bytes).min(data.len());
        assert_eq!(h, sha256(&data[range.clone()]), "journal line for chunk {i} has a wrong digest");
        assert_eq!(sha256(&partial[range]), h, "chunk {i} is journaled but its bytes are not in the partial");
        n += 1;
    }
    n
}

#[test]
fn sigkill_at_random_points_then_rerun_gives_identical_file() {
    let hub = FakeHub::start();
    let data = bytes(4 << 20, 42);
    let want = sha256(&data);
    hub.add_file("org/kill-GGUF", "kill-Q4_K_M.gguf", data.clone(), true);
    // About 0.5 s for the whole file over four connections, so most kills land mid-transfer.
    hub.set_throttle(Some(2 << 20));
    let mut rng = Rng(seed());
    let dir = tempfile::tempdir().unwrap();
    let dest = dir.path().join("hub/org/kill-GGUF/kill-Q4_K_M.gguf");
    let mut mid_transfer = 0;
    for round in 0..10 {
        let after = Duration::from_millis(20 + rng.below(600));
        let finished = pull_and_kill(&hub, dir.path(), &["org/kill-GGUF", "Q4_K_M"], after);
        let journaled = check_journal(&dest, &data, 128 << 10);
        // Whatever moment the kill hit, a file under the final name is the verified one.
        let complete = dest.exists();
        if complete {
            assert_eq!(
                sha256(&std::fs::read(&dest).unwrap()),
                want,
                "round {round}: final name holds unverified bytes"
            );
        } else {
            mid_transfer += 1;
        }
        println!("round {round}: kill after {after:?}: exited first {finished}, {journaled} chunks journaled, final present {complete}");
        if complete && round < 9 {
            // Start over so that later kills land in a transfer again.
            // A kill between the final rename and the manifest's write leaves no manifests folder.
            for sub in ["hub", "manifests"] {
                match std::fs::remove_dir_all(dir.path().join(sub)) {
                    Err(e) if e.kind() != std::io::ErrorKind::NotFound => panic!("removing {sub}: {e}"),
                    _ => {}
                }
            }
        }
    }
    assert!(mid_transfer >= 3, "only {mid_transfer} of 10 kills landed before the end: the test lost its point");
    let out = run(pull_cmd(&hub, dir.path(), &["org/kill-GGUF", "Q4_K_M"]));
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(sha256(&std::fs::read(&dest).unwrap()), want);
    assert!(!store::partial_path(&dest).exists() && !store::journal_path(&dest).exists());
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("org/kill-GGUF:Q4_K_M"), "{stdout}");
    println!("{mid_transfer} kills mid-transfer; served {} bytes in all", hub.stats().content_bytes_sent);
}

#[test]
fn damaged_partial_after_a_kill_is_detected_and_refetched() {
    let hub = FakeHub::start();
    let data = bytes(3 << 20, 7);
    hub.add_file("o/r", "r-Q8_0.gguf", data.clone(), true);
    hub.set_throttle(Some(1 << 20));
    let dir = tempfile::tempdir().unwrap();
    let dest = dir.path().join("hub/o/r/r-Q8_0.gguf");
    let journal = store::journal_path(&dest);
    // Kill once some chunks are journaled (the journal's header is its first line).
    let mut child = pull_cmd(&hub, dir.path(), &["o/r"]).stdout(Stdio::null()).stderr(Stdio::null()).spawn().unwrap();
    let start = Instant::now();
    while std::fs::read_to_string(&journal).map(|t| t.lines().count()).unwrap_or(0) < 4 {
        assert!(start.elapsed() < Duration::from_secs(20), "no chunk was journaled");
        std::thread::sleep(Duration::from_millis(5));
    }
    child.kill().unwrap();
    child.wait().unwrap();
    let text = std::fs::read_to_string(&journal).unwrap();
    let chunk: usize = text.lines().nth(1).unwrap().split(' ').next().unwrap().parse().unwrap();
    let partial = store::partial_path(&dest);
    let mut p = std::fs::read(&partial).unwrap();
    p[chunk * (128 << 10) + 17] ^= 0xff;
    std::fs::write(&partial, &p).unwrap();

    hub.set_throttle(None);
    let out = run(pull_cmd(&hub, dir.path(), &["o/r"]));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(stderr.contains(&format!("chunk {chunk} ")) && stderr.contains("reads back wrong"), "{stderr}");
    assert_eq!(sha256(&std::fs::read(&dest).unwrap()), sha256(&data));
}

#[test]
fn split_model_is_pulled_listed_and_opens() {
    use gguf::{GgmlType, GgufWriter, Value};
    let hub = FakeHub::start();
    let n_parts = 3u16;
    let mut expected = Vec::new();
    for no in 0..n_parts {
        let mut w = GgufWriter::new();
        w.set("general.architecture", Value::String("qwen3".into()));
        w.set("general.file_type", Value::U32(15));
        w.set("split.no", Value::U16(no));
        w.set("split.count", Value::U16(n_parts));
        w.set("split.tensors.count", Value::I32(n_parts as i32));
        let name = format!("blk.{no}.attn_q.weight");
        w.add_tensor(&name, GgmlType::F32, &[256, 64]).unwrap();
        let data = bytes(256 * 64 * 4, no as u64 + 1);
        let mut out = Vec::new();
        let mut sink = w.start(&mut out).unwrap();
        sink.write_data(&data).unwrap();
        sink.finish().unwrap();
        hub.add_file("o/split-GGUF", &format!("Q4_K_M/split-Q4_K_M-{:05}-of-{n_parts:05}.gguf", no + 1), out, true);
        expected.push((name, data));
    }
    hub.add_file("o/split-GGUF", "split-Q8_0.gguf", bytes(5000, 9), true);
    let dir = tempfile::tempdir().unwrap();
    let out = run(pull_cmd(&hub, dir.path(), &["o/split-GGUF:Q4_K_M"]));
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let stdout = String::from_utf8_lossy(&out.stdout);
    let first = PathBuf::from(stdout.lines().last().unwrap().trim());
    let model = gguf::GgufModel::open(&first).unwrap();
    assert_eq!(model.files().len(), 3);
    for (name, data) in &expected {
        assert_eq!(model.tensor(name).unwrap().data, &data[..]);
    }
    assert_eq!(store::resolve_model("o/split-GGUF:Q4_K_M", Some(dir.path())).unwrap(), first);

    let list = run({
        let mut c = Command::new(BIN);
        c.args(["models", "list", "--json", "--store"]).arg(dir.path());
        c
    });
    assert!(list.status.success(), "{}", String::from_utf8_lossy(&list.stderr));
    let v: serde_json::Value = serde_json::from_slice(&list.stdout).unwrap();
    let m = &v["models"][0];
    assert_eq!(m["name"], "o/split-GGUF:Q4_K_M");
    assert_eq!(m["architecture"], "qwen3");
    assert_eq!(m["quant"], "Q4_K_M");
    assert_eq!(m["files"].as_array().unwrap().len(), 3);

    let rm = run({
        let mut c = Command::new(BIN);
        c.args(["models", "rm", "o/split-GGUF:Q4_K_M", "--store"]).arg(dir.path());
        c
    });
    assert!(rm.status.success(), "{}", String::from_utf8_lossy(&rm.stderr));
    assert!(!first.exists());
}

#[test]
fn failures_print_one_line_and_exit_non_zero() {
    let hub = FakeHub::start();
    hub.add_file("o/r", "r-Q8_0.gguf", bytes(1000, 1), true);
    hub.make_private("o/private", "tok");
    hub.add_file("o/private", "p-Q8_0.gguf", bytes(1000, 2), true);
    let dir = tempfile::tempdir().unwrap();
    for (args, needle) in [
        (&["o/missing"][..], "not found (HTTP 404"),
        (&["o/r", "Q2_K"][..], "available: Q8_0"),
        (&["o/private"][..], "HF_TOKEN"),
    ] {
        let out = run(pull_cmd(&hub, dir.path(), args));
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{args:?}: {stderr}");
        let lines: Vec<&str> = stderr.lines().collect();
        assert_eq!(lines.len(), 1, "{args:?}: {stderr}");
        assert!(lines[0].starts_with("error: ") && lines[0].contains(needle), "{args:?}: {stderr}");
    }
}

/// The shared fixtures folder, seen from this crate.
fn fixtures_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../../shared/fixtures")
}

/// Writes `model` as a 3-part split set the way llama.cpp's gguf-split does: all metadata in
/// the first part, `split.*` keys in every part, tensors in order spread over the parts.
fn split_three_ways(model: &gguf::GgufModel) -> Vec<Vec<u8>> {
    use gguf::{GgufWriter, Value};
    let tensors: Vec<_> = model.tensors().collect();
    let n_parts = 3usize;
    let per = tensors.len().div_ceil(n_parts);
    (0..n_parts)
        .map(|no| {
            let mut w = GgufWriter::new();
            if no == 0 {
                w.set_all(model.metadata());
            }
            w.set("split.no", Value::U16(no as u16));
            w.set("split.count", Value::U16(n_parts as u16));
            w.set("split.tensors.count", Value::I32(tensors.len() as i32));
            let mine = &tensors[(no * per).min(tensors.len())..((no + 1) * per).min(tensors.len())];
            for t in mine {
                w.add_tensor(t.name(), t.dtype(), t.shape()).unwrap();
            }
            let mut out = Vec::new();
            let mut sink = w.start(&mut out).unwrap();
            for t in mine {
                sink.write_data(t.data).unwrap();
            }
            sink.finish().unwrap();
            out
        })
        .collect()
}

fn eval_json(model: &Path, ids: &str) -> serde_json::Value {
    let out = run({
        let mut c = Command::new(BIN);
        c.arg("eval").arg("-m").arg(model).args(["--ids", ids, "--n-gen", "8", "--json", "--threads", "1"]);
        c
    });
    assert!(out.status.success(), "eval {}: {}", model.display(), String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).unwrap()
}

#[test]
fn split_fixture_model_pulled_from_the_hub_runs_like_the_original() {
    let source = fixtures_dir().join("llama/model-q8_0.gguf");
    if !source.exists() {
        println!(
            "shared fixtures absent ({}): ran the synthetic split set only (split_model_is_pulled_listed_and_opens)",
            source.display()
        );
        return;
    }
    println!("full set: llama fixture q8_0 split in 3 parts, pulled and evaluated");
    let original = gguf::GgufModel::open(&source).unwrap();
    let parts = split_three_ways(&original);
    drop(original);
    let hub = FakeHub::start();
    for (no, bytes) in parts.into_iter().enumerate() {
        hub.add_file("fixtures/llama-GGUF", &format!("Q8_0/llama-Q8_0-{:05}-of-00003.gguf", no + 1), bytes, true);
    }
    let dir = tempfile::tempdir().unwrap();
    let out = run(pull_cmd(&hub, dir.path(), &["fixtures/llama-GGUF", "Q8_0"]));
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let first = store::resolve_model("fixtures/llama-GGUF:Q8_0", Some(dir.path())).unwrap();
    assert!(first.ends_with("Q8_0/llama-Q8_0-00001-of-00003.gguf"), "{}", first.display());

    let refs: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fixtures_dir().join("llama/ref.json")).unwrap()).unwrap();
    let ids: Vec<String> = refs["prompt"]["ids"].as_array().unwrap().iter().map(|v| v.to_string()).collect();
    let ids = ids.join(",");
    let split = eval_json(&first, &ids);
    let whole = eval_json(&source, &ids);
    assert_eq!(split, whole, "the split set evaluates differently from the file it was cut from");
    // llama.cpp's greedy continuation of the same file (shared/fixtures/llama/ref.json).
    let want: Vec<u64> =
        refs["llama_cpp"]["q8_0"]["greedy"].as_array().unwrap()[..8].iter().map(|v| v.as_u64().unwrap()).collect();
    let got: Vec<u64> = split["greedy"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap()).collect();
    assert_eq!(got, want, "greedy ids of the pulled split model vs llama.cpp");
}
