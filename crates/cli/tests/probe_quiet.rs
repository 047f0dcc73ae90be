//! `diskformer probe` on a headless machine prints the machine and nothing else: Mesa's
//! device-select Vulkan layer (mesa-vulkan-drivers, which CI installs for lavapipe) would print
//! "error: XDG_RUNTIME_DIR is invalid or not set in the environment." on every run that looks
//! for a GPU unless the binary quiets it.

use std::process::Command;

const BIN: &str = env!("CARGO_BIN_EXE_diskformer");

#[test]
fn probe_without_a_display_prints_no_display_errors() {
    let out = Command::new(BIN)
        .arg("probe")
        .env_remove("XDG_RUNTIME_DIR")
        .env_remove("WAYLAND_DISPLAY")
        .env_remove("DISPLAY")
        .env_remove("NODEVICE_SELECT")
        .output()
        .expect("diskformer runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "probe failed: {stderr}");
    assert!(stdout.contains("cpu "), "probe lists the CPU: {stdout}");
    assert!(!stderr.contains("XDG_RUNTIME_DIR"), "display errors on stderr: {stderr}");
}
