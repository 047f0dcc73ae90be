//! Runs tests/server/run.sh: the official `openai` and `anthropic` Python clients against
//! `diskformer serve`. Needs python3 with venv and pip (network for the first install);
//! DISKFORMER_SKIP_PY_CLIENTS=1 skips it, saying so.

use std::path::Path;
use std::process::Command;

#[test]
fn python_clients_talk_to_the_server() {
    if std::env::var("DISKFORMER_SKIP_PY_CLIENTS").is_ok_and(|v| v == "1") {
        eprintln!("SKIPPED: DISKFORMER_SKIP_PY_CLIENTS=1");
        return;
    }
    let repo = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let python = Command::new("python3").arg("--version").output();
    assert!(
        python.is_ok_and(|o| o.status.success()),
        "python3 is missing: install it (with venv and pip) or set DISKFORMER_SKIP_PY_CLIENTS=1"
    );
    let out = Command::new("bash")
        .arg(repo.join("tests/server/run.sh"))
        .arg(env!("CARGO_BIN_EXE_diskformer"))
        .output()
        .expect("running tests/server/run.sh");
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    eprintln!("{text}");
    assert!(out.status.success(), "python client checks failed (status {:?}):\n{text}", out.status.code());
    assert!(text.contains("all client checks passed"));
}
