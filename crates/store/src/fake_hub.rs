//! A Hugging Face-compatible hub on 127.0.0.1, for tests (feature `fake-hub`).
//!
//! It speaks the part of the protocol the store uses, as the real hub does (see [`crate::Hub`]):
//! `GET /api/models/{repo}/tree/{rev}?recursive=true` (paginated with `Link`), `HEAD`/`GET
//! /{repo}/resolve/{rev}/{path}` (LFS files: a 302 to `/cdn/{sha256}` with `X-Linked-Size` and
//! `X-Linked-Etag`; plain files: 200 with `ETag` = git blob id), ranged `GET` with 206 and
//! `Content-Range`, `X-Error-Code` on 401/404. Knobs make it misbehave: throttle, cut
//! connections mid-body, require a token, publish a wrong digest, ignore `Range`.
//!
//! One thread per connection, `Connection: close` on every answer; plain `std::net`.

use sha1::Sha1;
use sha2::{Digest as _, Sha256};
use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// A file the fake hub serves.
#[derive(Clone)]
struct File {
    bytes: Arc<Vec<u8>>,
    sha256: String,
    git_sha1: String,
    lfs: bool,
}

#[derive(Default)]
struct Knobs {
    token: Option<String>,
    private_repos: Vec<String>,
    throttle_bytes_per_s: Option<u64>,
    drop_after_bytes: Option<u64>,
    drops_left: u32,
    ignore_range: bool,
    page_size: Option<usize>,
    published_sha256: BTreeMap<(String, String), String>,
    published_size: BTreeMap<(String, String), u64>,
}

/// Counters of what the hub served.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Stats {
    /// `HEAD` requests on resolve URLs.
    pub heads: u64,
    /// `GET`s of file content (resolve or cdn) that started a body.
    pub content_gets: u64,
    /// Of those, how many carried `Range`.
    pub ranged_gets: u64,
    /// Body bytes of file content sent.
    pub content_bytes_sent: u64,
    /// Most content bodies being sent at the same moment.
    pub max_concurrent_bodies: u64,
    /// Connections cut on purpose.
    pub drops: u64,
}

struct State {
    repos: Mutex<BTreeMap<String, BTreeMap<String, File>>>,
    knobs: Mutex<Knobs>,
    heads: AtomicU64,
    content_gets: AtomicU64,
    ranged_gets: AtomicU64,
    content_bytes_sent: AtomicU64,
    active_bodies: AtomicUsize,
    max_active_bodies: AtomicUsize,
    drops: AtomicU64,
    stop: AtomicBool,
}

/// A running fake hub; stops when dropped.
pub struct FakeHub {
    addr: std::net::SocketAddr,
    state: Arc<State>,
    accept: Option<std::thread::JoinHandle<()>>,
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

impl FakeHub {
    /// Starts a hub on a free port of 127.0.0.1.
    ///
    /// # Panics
    /// When no port can be bound (a test environment problem).
    pub fn start() -> FakeHub {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind 127.0.0.1:0");
        let addr = listener.local_addr().expect("local addr");
        let state = Arc::new(State {
            repos: Mutex::default(),
            knobs: Mutex::default(),
            heads: AtomicU64::new(0),
            content_gets: AtomicU64::new(0),
            ranged_gets: AtomicU64::new(0),
            content_bytes_sent: AtomicU64::new(0),
            active_bodies: AtomicUsize::new(0),
            max_active_bodies: AtomicUsize::new(0),
            drops: AtomicU64::new(0),
            stop: AtomicBool::new(false),
        });
        let st = Arc::clone(&state);
        let accept = std::thread::spawn(move || {
            for conn in listener.incoming() {
                if st.stop.load(Ordering::SeqCst) {
                    break;
                }
                let Ok(conn) = conn else { continue };
                let st = Arc::clone(&st);
                std::thread::spawn(move || {
                    let _ = serve(&st, conn, addr);
                });
            }
        });
        FakeHub { addr, state, accept: Some(accept) }
    }

    /// `http://127.0.0.1:PORT`, for `HF_ENDPOINT`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Adds (or replaces) a file. `lfs` files are served the way the hub serves LFS files.
    pub fn add_file(&self, repo: &str, path: &str, bytes: Vec<u8>, lfs: bool) {
        let sha256 = hex(&Sha256::digest(&bytes));
        let mut g = Sha1::new();
        g.update(format!("blob {}\0", bytes.len()).as_bytes());
        g.update(&bytes);
        let git_sha1 = hex(&g.finalize());
        let f = File { bytes: Arc::new(bytes), sha256, git_sha1, lfs };
        self.state.repos.lock().unwrap().entry(repo.to_string()).or_default().insert(path.to_string(), f);
    }

    /// Requires `Authorization: Bearer TOKEN` for `repo` (401 without it, 403 with a wrong one).
    pub fn make_private(&self, repo: &str, token: &str) {
        let mut k = self.state.knobs.lock().unwrap();
        k.token = Some(token.to_string());
        k.private_repos.push(repo.to_string());
    }

    /// Limits each content body to this rate (None: as fast as possible).
    pub fn set_throttle(&self, bytes_per_s: Option<u64>) {
        self.state.knobs.lock().unwrap().throttle_bytes_per_s = bytes_per_s;
    }

    /// Cuts the next `count` content bodies after `after_bytes` bytes each.
    pub fn drop_connections(&self, after_bytes: u64, count: u32) {
        let mut k = self.state.knobs.lock().unwrap();
        k.drop_after_bytes = Some(after_bytes);
        k.drops_left = count;
    }

    /// Answers ranged GETs with 200 and the whole file.
    pub fn set_ignore_range(&self, on: bool) {
        self.state.knobs.lock().unwrap().ignore_range = on;
    }

    /// Lists at most `n` entries per page of the tree listing.
    pub fn set_page_size(&self, n: Option<usize>) {
        self.state.knobs.lock().unwrap().page_size = n;
    }

    /// Publishes `sha256` for a file instead of its true digest (listing and `X-Linked-Etag`).
    pub fn publish_wrong_sha256(&self, repo: &str, path: &str, sha256: &str) {
        self.state
            .knobs
            .lock()
            .unwrap()
            .published_sha256
            .insert((repo.to_string(), path.to_string()), sha256.to_string());
    }

    /// Publishes `size_bytes` for a file instead of its true size (listing and `X-Linked-Size`).
    pub fn publish_size(&self, repo: &str, path: &str, size_bytes: u64) {
        self.state.knobs.lock().unwrap().published_size.insert((repo.to_string(), path.to_string()), size_bytes);
    }

    /// What was served so far.
    pub fn stats(&self) -> Stats {
        let s = &self.state;
        Stats {
            heads: s.heads.load(Ordering::SeqCst),
            content_gets: s.content_gets.load(Ordering::SeqCst),
            ranged_gets: s.ranged_gets.load(Ordering::SeqCst),
            content_bytes_sent: s.content_bytes_sent.load(Ordering::SeqCst),
            max_concurrent_bodies: s.max_active_bodies.load(Ordering::SeqCst) as u64,
            drops: s.drops.load(Ordering::SeqCst),
        }
    }
}

impl Drop for FakeHub {
    fn drop(&mut self) {
        self.state.stop.store(true, Ordering::SeqCst);
        let _ = TcpStream::connect(self.addr);
        if let Some(h) = self.accept.take() {
            let _ = h.join();
        }
    }
}

struct Request {
    method: String,
    target: String,
    headers: BTreeMap<String, String>,
}

fn read_request(conn: &TcpStream) -> std::io::Result<Option<Request>> {
    let mut r = BufReader::new(conn.try_clone()?);
    let mut line = String::new();
    if r.read_line(&mut line)? == 0 {
        return Ok(None);
    }
    let mut it = line.split_whitespace();
    let (Some(method), Some(target)) = (it.next(), it.next()) else { return Ok(None) };
    let mut headers = BTreeMap::new();
    loop {
        let mut h = String::new();
        if r.read_line(&mut h)? == 0 || h.trim().is_empty() {
            break;
        }
        if let Some((k, v)) = h.split_once(':') {
            headers.insert(k.trim().to_ascii_lowercase(), v.trim().to_string());
        }
    }
    Ok(Some(Request { method: method.to_string(), target: target.to_string(), headers }))
}

fn percent_decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%' && i + 2 < b.len() {
            if let Some(v) = std::str::from_utf8(&b[i + 1..i + 3]).ok().and_then(|h| u8::from_str_radix(h, 16).ok()) {
                out.push(v);
                i += 3;
                continue;
            }
        }
        out.push(b[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

fn respond(
    conn: &mut TcpStream,
    status: &str,
    headers: &[(String, String)],
    body: &[u8],
    head: bool,
) -> std::io::Result<()> {
    let mut s = format!("HTTP/1.1 {status}\r\nConnection: close\r\n");
    let mut has_len = false;
    for (k, v) in headers {
        has_len |= k.eq_ignore_ascii_case("content-length");
        s.push_str(&format!("{k}: {v}\r\n"));
    }
    if !has_len {
        s.push_str(&format!("Content-Length: {}\r\n", body.len()));
    }
    s.push_str("\r\n");
    conn.write_all(s.as_bytes())?;
    if !head {
        conn.write_all(body)?;
    }
    conn.flush()
}

fn error(conn: &mut TcpStream, status: &str, code: &str, head: bool) -> std::io::Result<()> {
    let h = vec![("X-Error-Code".to_string(), code.to_string()), ("X-Error-Message".to_string(), code.to_string())];
    respond(conn, status, &h, code.as_bytes(), head)
}

fn serve(st: &State, mut conn: TcpStream, addr: std::net::SocketAddr) -> std::io::Result<()> {
    let Some(req) = read_request(&conn)? else { return Ok(()) };
    let head = req.method == "HEAD";
    let (path, query) = match req.target.split_once('?') {
        Some((p, q)) => (p.to_string(), q.to_string()),
        None => (req.target.clone(), String::new()),
    };
    let authorized = |repo: &str| -> Result<(), (&'static str, &'static str)> {
        let k = st.knobs.lock().unwrap();
        if !k.private_repos.iter().any(|r| r == repo) {
            return Ok(());
        }
        match (req.headers.get("authorization"), &k.token) {
            (None, _) => Err(("401 Unauthorized", "RepoNotFound")),
            (Some(a), Some(t)) if a == &format!("Bearer {t}") => Ok(()),
            _ => Err(("403 Forbidden", "GatedRepo")),
        }
    };

    if let Some(rest) = path.strip_prefix("/cdn/") {
        let sha = rest.to_string();
        let file = st.repos.lock().unwrap().values().flat_map(|r| r.values()).find(|f| f.sha256 == sha).cloned();
        return match file {
            Some(f) => send_content(st, &mut conn, &req, &f, head, &[]),
            None => error(&mut conn, "404 Not Found", "EntryNotFound", head),
        };
    }

    if let Some(rest) = path.strip_prefix("/api/models/") {
        let Some((repo, rev)) = rest.split_once("/tree/") else {
            return error(&mut conn, "404 Not Found", "RepoNotFound", head);
        };
        let repo = percent_decode(repo);
        if let Err((s, c)) = authorized(&repo) {
            return error(&mut conn, s, c, head);
        }
        if percent_decode(rev) != "main" {
            return error(&mut conn, "404 Not Found", "RevisionNotFound", head);
        }
        let Some(files) = st.repos.lock().unwrap().get(&repo).cloned() else {
            return error(&mut conn, "404 Not Found", "RepoNotFound", head);
        };
        let knobs = st.knobs.lock().unwrap();
        let mut entries = Vec::new();
        let mut dirs = std::collections::BTreeSet::new();
        for (p, f) in &files {
            let mut d = p.as_str();
            while let Some((parent, _)) = d.rsplit_once('/') {
                dirs.insert(parent.to_string());
                d = parent;
            }
            let sha = knobs.published_sha256.get(&(repo.clone(), p.clone())).unwrap_or(&f.sha256);
            let size = knobs.published_size.get(&(repo.clone(), p.clone())).copied().unwrap_or(f.bytes.len() as u64);
            let mut e = serde_json::json!({"type": "file", "oid": f.git_sha1, "size": size, "path": p});
            if f.lfs {
                e["lfs"] = serde_json::json!({"oid": sha, "size": size, "pointerSize": 134});
            }
            entries.push(e);
        }
        for d in dirs {
            entries.push(serde_json::json!({"type": "directory", "oid": "0".repeat(40), "size": 0, "path": d}));
        }
        let cursor: usize =
            query.split('&').find_map(|kv| kv.strip_prefix("cursor=")).and_then(|c| c.parse().ok()).unwrap_or(0);
        let page = knobs.page_size.unwrap_or(usize::MAX);
        drop(knobs);
        let end = cursor.saturating_add(page).min(entries.len());
        let body = serde_json::to_vec(&entries[cursor.min(end)..end]).unwrap_or_default();
        let mut h = vec![("Content-Type".to_string(), "application/json".to_string())];
        if end < entries.len() {
            h.push((
                "Link".into(),
                format!("<http://{addr}/api/models/{repo}/tree/main?recursive=true&cursor={end}>; rel=\"next\""),
            ));
        }
        return respond(&mut conn, "200 OK", &h, &body, head);
    }

    let Some((repo, rest)) = path.trim_start_matches('/').split_once("/resolve/") else {
        return error(&mut conn, "404 Not Found", "RepoNotFound", head);
    };
    let repo = percent_decode(repo);
    if let Err((s, c)) = authorized(&repo) {
        return error(&mut conn, s, c, head);
    }
    let Some((rev, file_path)) = rest.split_once('/') else {
        return error(&mut conn, "404 Not Found", "EntryNotFound", head);
    };
    let Some(files) = st.repos.lock().unwrap().get(&repo).cloned() else {
        return error(&mut conn, "404 Not Found", "RepoNotFound", head);
    };
    if percent_decode(rev) != "main" {
        return error(&mut conn, "404 Not Found", "RevisionNotFound", head);
    }
    let file_path = percent_decode(file_path);
    let Some(f) = files.get(&file_path).cloned() else {
        return error(&mut conn, "404 Not Found", "EntryNotFound", head);
    };
    if head {
        st.heads.fetch_add(1, Ordering::SeqCst);
    }
    let commit = ("X-Repo-Commit".to_string(), "0123456789abcdef0123456789abcdef01234567".to_string());
    if f.lfs {
        let key = (repo.clone(), file_path.clone());
        let (published, size) = {
            let k = st.knobs.lock().unwrap();
            (k.published_sha256.get(&key).cloned(), k.published_size.get(&key).copied())
        };
        let sha = published.unwrap_or_else(|| f.sha256.clone());
        let size = size.unwrap_or(f.bytes.len() as u64);
        let h = vec![
            ("Location".to_string(), format!("http://{addr}/cdn/{}", f.sha256)),
            ("X-Linked-Size".to_string(), size.to_string()),
            ("X-Linked-Etag".to_string(), format!("\"{sha}\"")),
            ("ETag".to_string(), format!("\"{}\"", f.git_sha1)),
            commit,
        ];
        return respond(&mut conn, "302 Found", &h, b"", head);
    }
    let extra = vec![("ETag".to_string(), format!("\"{}\"", f.git_sha1)), commit];
    send_content(st, &mut conn, &req, &f, head, &extra)
}

fn send_content(
    st: &State,
    conn: &mut TcpStream,
    req: &Request,
    f: &File,
    head: bool,
    extra: &[(String, String)],
) -> std::io::Result<()> {
    let total = f.bytes.len() as u64;
    let (ignore_range, throttle) = {
        let k = st.knobs.lock().unwrap();
        (k.ignore_range, k.throttle_bytes_per_s)
    };
    let range = req.headers.get("range").filter(|_| !ignore_range).and_then(|r| {
        let spec = r.strip_prefix("bytes=")?;
        let (a, b) = spec.split_once('-')?;
        let a: u64 = a.parse().ok()?;
        let b: u64 =
            if b.is_empty() { total.checked_sub(1)? } else { b.parse::<u64>().ok()?.min(total.checked_sub(1)?) };
        (a <= b).then_some((a, b))
    });
    let mut h: Vec<(String, String)> = extra.to_vec();
    h.push(("Accept-Ranges".into(), "bytes".into()));
    let (status, start, end) = match range {
        Some((a, b)) => {
            h.push(("Content-Range".into(), format!("bytes {a}-{b}/{total}")));
            ("206 Partial Content", a, b + 1)
        }
        None => ("200 OK", 0, total),
    };
    h.push(("Content-Length".into(), (end - start).to_string()));
    let mut s = format!("HTTP/1.1 {status}\r\nConnection: close\r\n");
    for (k, v) in &h {
        s.push_str(&format!("{k}: {v}\r\n"));
    }
    s.push_str("\r\n");
    conn.write_all(s.as_bytes())?;
    if head {
        return conn.flush();
    }
    st.content_gets.fetch_add(1, Ordering::SeqCst);
    if range.is_some() {
        st.ranged_gets.fetch_add(1, Ordering::SeqCst);
    }
    let cut_after = {
        let mut k = st.knobs.lock().unwrap();
        match k.drop_after_bytes {
            Some(n) if k.drops_left > 0 => {
                k.drops_left -= 1;
                Some(n)
            }
            _ => None,
        }
    };
    let active = st.active_bodies.fetch_add(1, Ordering::SeqCst) + 1;
    st.max_active_bodies.fetch_max(active, Ordering::SeqCst);
    let result = (|| {
        let started = Instant::now();
        let mut pos = start;
        let mut sent = 0u64;
        while pos < end {
            let mut n = (end - pos).min(16 << 10);
            if let Some(c) = cut_after {
                if sent >= c {
                    st.drops.fetch_add(1, Ordering::SeqCst);
                    // Reset rather than close cleanly, as a dropped link looks to the client.
                    let _ = conn.shutdown(std::net::Shutdown::Both);
                    return Ok(());
                }
                n = n.min(c - sent);
            }
            conn.write_all(&f.bytes[pos as usize..(pos + n) as usize])?;
            pos += n;
            sent += n;
            st.content_bytes_sent.fetch_add(n, Ordering::SeqCst);
            if let Some(rate) = throttle {
                let due = Duration::from_secs_f64(sent as f64 / rate as f64);
                if let Some(wait) = due.checked_sub(started.elapsed()) {
                    std::thread::sleep(wait);
                }
            }
        }
        conn.flush()
    })();
    st.active_bodies.fetch_sub(1, Ordering::SeqCst);
    result
}
