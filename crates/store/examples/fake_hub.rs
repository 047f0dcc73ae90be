//! A fake hub to try `diskformer pull` by hand, offline:
//!
//! ```text
//! cargo run -p store --features fake-hub --example fake_hub -- 64 8
//! HF_ENDPOINT=http://127.0.0.1:PORT diskformer pull demo/demo-GGUF Q4_K_M --store /tmp/store
//! ```
//! Arguments: file size in MiB (default 64), throttle per connection in MiB/s (default 8).
//! Serves `demo/demo-GGUF` with `demo-Q4_K_M.gguf` (pseudo-random bytes) until killed.

fn main() {
    let mut args = std::env::args().skip(1).map(|a| a.parse::<u64>().expect("a number"));
    let size_mib = args.next().unwrap_or(64);
    let throttle_mib_s = args.next().unwrap_or(8);
    let hub = store::fake_hub::FakeHub::start();
    let mut x = 0x9e3779b97f4a7c15u64;
    let data: Vec<u8> = (0..size_mib << 20)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect();
    hub.add_file("demo/demo-GGUF", "demo-Q4_K_M.gguf", data, true);
    hub.set_throttle(Some(throttle_mib_s << 20));
    println!("{}", hub.url());
    loop {
        std::thread::park();
    }
}
