//! One file, fetched in ranged chunks over several connections, resumable after any kill,
//! verified before it takes its final name.
//!
//! On disk, beside the final name `F`:
//! - `F.partial`: the file being assembled, pre-sized to the full length (sparse); chunk `i`
//!   lives at its own offset, written by whichever connection fetched it;
//! - `F.partial.chunks`: a text journal. Line 1 names the file's size, chunk size and published
//!   digest; each further line `i <sha256>` says chunk `i` is complete and gives the digest of
//!   the bytes that arrived from the network. A line is appended only after the chunk's bytes
//!   are written and `fdatasync`ed, so after a SIGKILL or power loss every journaled chunk is
//!   really on disk; a torn last line is ignored.
//!
//! A verifier thread walks the chunks in order while the connections fetch: it reads each
//! journaled chunk back from disk, checks it against its journaled digest (a mismatch means the
//! partial was damaged: that chunk is fetched again), and feeds it to the whole-file digest. On a
//! resume it re-reads the chunks already present, so a corrupted partial is caught before the
//! file is used. When the last chunk is verified the whole-file digest is compared with the
//! hub's, and only then is `F.partial` renamed to `F`.

use crate::error::{io_err, is_disk_full, Result, StoreError};
use crate::hub::{Digest, FetchFailure, Hub};
use sha1::Sha1;
use sha2::{Digest as _, Sha256};
use std::collections::VecDeque;
use std::fs::{File, OpenOptions};
use std::io::{Read, Write};
use std::ops::ControlFlow;
use std::path::{Path, PathBuf};
use std::sync::{Condvar, Mutex};
use std::time::Duration;

/// How a pull fetches: connections, chunk size, retries.
#[derive(Clone, Debug)]
pub struct DownloadOptions {
    /// Ranged requests in flight at once for one file.
    pub connections: usize,
    /// Bytes per ranged request; also the unit of resume (a killed chunk is fetched again).
    pub chunk_bytes: u64,
    /// Consecutive failed attempts (without a byte of progress) before a chunk gives up.
    pub max_attempts: u32,
    /// Wait before the first retry; doubles each time, up to 30 s.
    pub retry_backoff: Duration,
}

impl Default for DownloadOptions {
    /// 4 connections, 32 MiB chunks, 6 attempts, 1 s first backoff.
    fn default() -> Self {
        DownloadOptions {
            connections: 4,
            chunk_bytes: 32 << 20,
            max_attempts: 6,
            retry_backoff: Duration::from_secs(1),
        }
    }
}

/// What a pull reports while it runs. Called from several threads at once.
pub trait PullObserver: Sync {
    /// A file starts: its path in the repo, its size, and how many bytes a previous run
    /// already left in the partial (to be re-verified, not re-fetched).
    fn file_started(&self, _repo_path: &str, _size_bytes: u64, _resumed_bytes: u64) {}
    /// `n_bytes` more arrived. Return `Break` to stop the pull (the partial is kept).
    fn bytes_downloaded(&self, _n_bytes: u64) -> ControlFlow<()> {
        ControlFlow::Continue(())
    }
    /// A chunk of the partial read back wrong and will be fetched again.
    fn chunk_corrupted(&self, _repo_path: &str, _chunk_index: usize, _offset: u64, _len: u64) {}
    /// A transient failure; the chunk is retried after `wait`.
    fn retrying(&self, _repo_path: &str, _attempt: u32, _reason: &str, _wait: Duration) {}
    /// The file is verified and has its final name (`downloaded` false: it was already there).
    fn file_finished(&self, _repo_path: &str, _downloaded: bool) {}
}

/// An observer that ignores everything.
pub struct Quiet;
impl PullObserver for Quiet {}

/// What to fetch and where.
pub(crate) struct Target<'a> {
    /// Path in the repo, for messages.
    pub repo_path: &'a str,
    /// The final file name.
    pub dest: &'a Path,
    /// Content size.
    pub size_bytes: u64,
    /// Published digest.
    pub digest: &'a Digest,
}

/// Where the bytes come from; `refresh` asks the hub again when a signed URL expired.
pub(crate) struct Source<'a> {
    pub hub: &'a Hub,
    pub url: Mutex<String>,
    pub refresh: &'a (dyn Fn() -> Result<String> + Sync),
}

impl Source<'_> {
    fn current(&self) -> String {
        self.url.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }
}

/// `F.partial`.
pub fn partial_path(dest: &Path) -> PathBuf {
    with_suffix(dest, ".partial")
}

/// `F.partial.chunks`.
pub fn journal_path(dest: &Path) -> PathBuf {
    with_suffix(dest, ".partial.chunks")
}

/// `F.verified`: the digest `F` was verified against, written after the rename.
pub fn verified_path(dest: &Path) -> PathBuf {
    with_suffix(dest, ".verified")
}

fn with_suffix(p: &Path, suffix: &str) -> PathBuf {
    let mut s = p.as_os_str().to_owned();
    s.push(suffix);
    PathBuf::from(s)
}

/// The record kept beside a verified file: `ALGORITHM HEX SIZE`.
fn verified_record(digest: &Digest, size_bytes: u64) -> String {
    format!("{} {} {size_bytes}\n", digest.algorithm(), digest.hex())
}

/// True when `dest` exists with a record saying it was verified against `digest` and its size
/// still matches.
pub(crate) fn already_verified(dest: &Path, digest: &Digest, size_bytes: u64) -> bool {
    let Ok(meta) = std::fs::metadata(dest) else { return false };
    let Ok(rec) = std::fs::read_to_string(verified_path(dest)) else { return false };
    meta.len() == size_bytes && rec == verified_record(digest, size_bytes)
}

/// Hashes a whole file the way `digest` is defined.
pub(crate) fn hash_file(path: &Path, digest: &Digest) -> Result<String> {
    let mut f = File::open(path).map_err(io_err("open", path))?;
    let len = f.metadata().map_err(io_err("stat", path))?.len();
    let mut h = WholeHasher::new(digest, len);
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f.read(&mut buf).map_err(io_err("read", path))?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
    }
    Ok(h.finish_hex())
}

/// Writes the `.verified` record (fsynced) for a file that now holds verified content.
pub(crate) fn record_verified(dest: &Path, digest: &Digest, size_bytes: u64) -> Result<()> {
    let rec = verified_path(dest);
    let mut f = File::create(&rec).map_err(io_err("create", &rec))?;
    f.write_all(verified_record(digest, size_bytes).as_bytes()).map_err(io_err("write", &rec))?;
    f.sync_all().map_err(io_err("sync", &rec))
}

#[derive(Clone)]
enum WholeHasher {
    Sha256(Sha256),
    GitSha1(Sha1),
}

impl WholeHasher {
    fn new(d: &Digest, size_bytes: u64) -> WholeHasher {
        match d {
            Digest::Sha256(_) => WholeHasher::Sha256(Sha256::new()),
            Digest::GitSha1(_) => {
                let mut h = Sha1::new();
                h.update(format!("blob {size_bytes}\0").as_bytes());
                WholeHasher::GitSha1(h)
            }
        }
    }
    fn update(&mut self, b: &[u8]) {
        match self {
            WholeHasher::Sha256(h) => h.update(b),
            WholeHasher::GitSha1(h) => h.update(b),
        }
    }
    fn finish_hex(self) -> String {
        match self {
            WholeHasher::Sha256(h) => hex(&h.finalize()),
            WholeHasher::GitSha1(h) => hex(&h.finalize()),
        }
    }
}

pub(crate) fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// The journal: header plus the digest of each complete chunk.
struct Journal {
    chunk_bytes: u64,
    done: Vec<Option<String>>,
}

fn journal_header(t: &Target<'_>, chunk_bytes: u64) -> String {
    format!(
        "diskformer-partial 1 size={} chunk={chunk_bytes} {}={}\n",
        t.size_bytes,
        t.digest.algorithm(),
        t.digest.hex()
    )
}

/// Reads a journal; `None` when missing, unreadable, or for another file/version.
fn read_journal(path: &Path, t: &Target<'_>) -> Option<Journal> {
    let text = std::fs::read_to_string(path).ok()?;
    let mut lines = text.split_inclusive('\n');
    let header = lines.next()?;
    let chunk_bytes: u64 = header.split_whitespace().find_map(|w| w.strip_prefix("chunk="))?.parse().ok()?;
    if chunk_bytes == 0 || header != journal_header(t, chunk_bytes) {
        return None;
    }
    let n_chunks = n_chunks(t.size_bytes, chunk_bytes);
    let mut done = vec![None; n_chunks];
    for line in lines {
        // A line without its newline was torn by a kill mid-append: it never counted.
        let Some(line) = line.strip_suffix('\n') else { break };
        let mut w = line.split(' ');
        let (Some(i), Some(h), None) = (w.next(), w.next(), w.next()) else { continue };
        let (Ok(i), true) = (i.parse::<usize>(), h.len() == 64 && h.bytes().all(|c| c.is_ascii_hexdigit())) else {
            continue;
        };
        if i < n_chunks {
            done[i] = Some(h.to_string());
        }
    }
    Some(Journal { chunk_bytes, done })
}

/// Bytes of `dest` a previous run already journaled as complete (0 without a usable journal).
pub(crate) fn journaled_bytes(dest: &Path, size_bytes: u64, digest: &Digest) -> u64 {
    let t = Target { repo_path: "", dest, size_bytes, digest };
    let Some(j) = read_journal(&journal_path(dest), &t) else { return 0 };
    (0..j.done.len())
        .filter(|&i| j.done[i].is_some())
        .map(|i| ((i as u64 + 1) * j.chunk_bytes).min(size_bytes) - i as u64 * j.chunk_bytes)
        .sum()
}

fn n_chunks(size: u64, chunk: u64) -> usize {
    size.div_ceil(chunk).max(1) as usize
}

struct Shared {
    pending: VecDeque<usize>,
    done: Vec<Option<String>>,
    error: Option<StoreError>,
}

struct Job<'a> {
    t: &'a Target<'a>,
    src: &'a Source<'a>,
    opts: &'a DownloadOptions,
    obs: &'a dyn PullObserver,
    file: &'a File,
    partial: &'a Path,
    journal: Mutex<File>,
    chunk_bytes: u64,
    n_chunks: usize,
    shared: Mutex<Shared>,
    changed: Condvar,
}

/// Fetches `t` into place. Returns `false` when it was already there, verified.
///
/// # Errors
/// Network and hub errors (partial kept), [`StoreError::DiskFull`] (kept),
/// [`StoreError::ChecksumMismatch`] (partial removed), [`StoreError::Busy`],
/// [`StoreError::Cancelled`] (kept), [`StoreError::Corruption`], I/O errors.
pub(crate) fn download(
    t: &Target<'_>,
    src: &Source<'_>,
    opts: &DownloadOptions,
    obs: &dyn PullObserver,
) -> Result<bool> {
    if already_verified(t.dest, t.digest, t.size_bytes) {
        remove_stale_journal(t.dest);
        obs.file_finished(t.repo_path, false);
        return Ok(false);
    }
    let dir = t.dest.parent().unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir).map_err(io_err("create directory", dir))?;
    // A final file without a record: a kill came between rename and record. Hash it rather
    // than fetch it again.
    if std::fs::metadata(t.dest).is_ok_and(|m| m.len() == t.size_bytes)
        && hash_file(t.dest, t.digest)? == t.digest.hex()
    {
        record_verified(t.dest, t.digest, t.size_bytes)?;
        remove_stale_journal(t.dest);
        obs.file_finished(t.repo_path, false);
        return Ok(false);
    }

    let partial = partial_path(t.dest);
    let journal_file = journal_path(t.dest);
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(&partial)
        .map_err(io_err("open", &partial))?;
    lock_exclusive(&file, &partial)?;

    let (chunk_bytes, done) = match read_journal(&journal_file, t) {
        Some(j) => (j.chunk_bytes, j.done),
        None => {
            // No journal, or one for another version of the file: nothing in the partial can
            // be trusted.
            file.set_len(0).map_err(io_err("truncate", &partial))?;
            let chunk = opts.chunk_bytes.max(1);
            let mut jf = File::create(&journal_file).map_err(io_err("create", &journal_file))?;
            jf.write_all(journal_header(t, chunk).as_bytes()).map_err(io_err("write", &journal_file))?;
            jf.sync_all().map_err(io_err("sync", &journal_file))?;
            (chunk, vec![None; n_chunks(t.size_bytes, chunk)])
        }
    };
    if file.metadata().map_err(io_err("stat", &partial))?.len() != t.size_bytes {
        file.set_len(t.size_bytes).map_err(io_err("resize", &partial))?;
    }
    let n = done.len();
    let range = |i: usize| (i as u64 * chunk_bytes, ((i as u64 + 1) * chunk_bytes).min(t.size_bytes));
    let resumed_bytes: u64 = (0..n).filter(|&i| done[i].is_some()).map(|i| range(i).1 - range(i).0).sum();
    let need_bytes = t.size_bytes - resumed_bytes;
    if let Some(available_bytes) = available_space(dir) {
        if available_bytes < need_bytes {
            return Err(StoreError::DiskFull { dir: dir.to_path_buf(), need_bytes, available_bytes });
        }
    }
    obs.file_started(t.repo_path, t.size_bytes, resumed_bytes);

    let journal = OpenOptions::new().append(true).open(&journal_file).map_err(io_err("open", &journal_file))?;
    let pending = (0..n).filter(|&i| done[i].is_none()).collect();
    let job = Job {
        t,
        src,
        opts,
        obs,
        file: &file,
        partial: &partial,
        journal: Mutex::new(journal),
        chunk_bytes,
        n_chunks: n,
        shared: Mutex::new(Shared { pending, done, error: None }),
        changed: Condvar::new(),
    };
    let digest = std::thread::scope(|s| {
        let workers = opts.connections.clamp(1, 64).min(n);
        for _ in 0..workers {
            s.spawn(|| job.work());
        }
        let r = job.verify();
        if r.is_err() {
            // Stop the connections; the verifier's own error is the one reported.
            job.fail(StoreError::Cancelled);
        }
        r
    });
    let worker_error = job.shared.into_inner().unwrap_or_else(|p| p.into_inner()).error;
    let digest = match (digest, worker_error) {
        (Err(StoreError::Cancelled), Some(e)) | (Ok(_), Some(e)) => return Err(e),
        (Err(e), _) => return Err(e),
        (Ok(d), None) => d,
    };
    if digest != t.digest.hex() {
        drop(file);
        let _ = std::fs::remove_file(&partial);
        let _ = std::fs::remove_file(&journal_file);
        return Err(StoreError::ChecksumMismatch {
            file: t.repo_path.to_string(),
            algorithm: t.digest.algorithm(),
            expected: t.digest.hex().to_string(),
            actual: digest,
        });
    }
    file.sync_all().map_err(io_err("sync", &partial))?;
    // The old record must not vouch for the new content, even for an instant.
    let _ = std::fs::remove_file(verified_path(t.dest));
    std::fs::rename(&partial, t.dest).map_err(io_err("rename", &partial))?;
    sync_dir(dir);
    record_verified(t.dest, t.digest, t.size_bytes)?;
    drop(file);
    let _ = std::fs::remove_file(&journal_file);
    obs.file_finished(t.repo_path, true);
    Ok(true)
}

/// A journal whose partial is gone was left by a kill between the rename and its removal.
fn remove_stale_journal(dest: &Path) {
    if !partial_path(dest).exists() {
        let _ = std::fs::remove_file(journal_path(dest));
    }
}

impl Job<'_> {
    fn range(&self, i: usize) -> (u64, u64) {
        (i as u64 * self.chunk_bytes, ((i as u64 + 1) * self.chunk_bytes).min(self.t.size_bytes))
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Shared> {
        self.shared.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn stopped(&self) -> bool {
        self.lock().error.is_some()
    }

    fn fail(&self, e: StoreError) {
        let mut s = self.lock();
        if s.error.is_none() {
            s.error = Some(e);
        }
        drop(s);
        self.changed.notify_all();
    }

    /// A connection: takes pending chunks until none are left or something failed.
    fn work(&self) {
        loop {
            let i = {
                let mut s = self.lock();
                if s.error.is_some() {
                    return;
                }
                match s.pending.pop_front() {
                    Some(i) => i,
                    None => return,
                }
            };
            match self.fetch_chunk(i) {
                Ok(h) => {
                    self.lock().done[i] = Some(h);
                    self.changed.notify_all();
                }
                Err(e) => {
                    self.fail(e);
                    return;
                }
            }
        }
    }

    /// Fetches chunk `i`, writes it at its offset, syncs, journals it; returns its sha256.
    fn fetch_chunk(&self, i: usize) -> Result<String> {
        let (start, end) = self.range(i);
        let mut pos = start;
        let mut hasher = Sha256::new();
        let mut attempts = 0u32;
        let mut refreshes = 0u32;
        let mut buf = vec![0u8; 256 << 10];
        while pos < end {
            if self.stopped() {
                return Err(StoreError::Cancelled);
            }
            let url = self.src.current();
            let failure = match self.src.hub.get_range(&url, pos, end, self.t.size_bytes) {
                Ok(mut resp) => {
                    let mut failure = None;
                    while pos < end {
                        let want = buf.len().min((end - pos) as usize);
                        match resp.read(&mut buf[..want]) {
                            Ok(0) => {
                                failure = Some(format!("connection closed at byte {pos} of {}", self.t.size_bytes));
                                break;
                            }
                            Ok(n) => {
                                self.write_at(&buf[..n], pos)?;
                                hasher.update(&buf[..n]);
                                pos += n as u64;
                                attempts = 0;
                                if self.obs.bytes_downloaded(n as u64).is_break() {
                                    return Err(StoreError::Cancelled);
                                }
                                if self.stopped() {
                                    return Err(StoreError::Cancelled);
                                }
                            }
                            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                            Err(e) => {
                                failure = Some(format!("{e} at byte {pos} of {}", self.t.size_bytes));
                                break;
                            }
                        }
                    }
                    match failure {
                        Some(f) => f,
                        None => break,
                    }
                }
                Err(FetchFailure::Transient(f)) => f,
                Err(FetchFailure::Expired(e)) => {
                    refreshes += 1;
                    if refreshes > 2 {
                        return Err(e);
                    }
                    let fresh = (self.src.refresh)()?;
                    *self.src.url.lock().unwrap_or_else(|p| p.into_inner()) = fresh;
                    continue;
                }
                Err(FetchFailure::Permanent(e)) => return Err(e),
            };
            attempts += 1;
            if attempts >= self.opts.max_attempts {
                return Err(StoreError::Interrupted {
                    file: self.t.repo_path.to_string(),
                    attempts,
                    reason: failure,
                    partial: self.partial.to_path_buf(),
                });
            }
            let wait = self.opts.retry_backoff.saturating_mul(1 << (attempts - 1).min(5)).min(Duration::from_secs(30));
            self.obs.retrying(self.t.repo_path, attempts, &failure, wait);
            std::thread::sleep(wait);
        }
        // Journal only what is durably on disk.
        self.file.sync_data().map_err(|e| self.write_error(e, "sync"))?;
        let h = hex(&hasher.finalize());
        let mut j = self.journal.lock().unwrap_or_else(|p| p.into_inner());
        let jp = journal_path(self.t.dest);
        j.write_all(format!("{i} {h}\n").as_bytes()).map_err(io_err("append to", &jp))?;
        j.sync_data().map_err(io_err("sync", &jp))?;
        Ok(h)
    }

    fn write_at(&self, bytes: &[u8], offset: u64) -> Result<()> {
        write_all_at(self.file, bytes, offset).map_err(|e| self.write_error(e, "write"))
    }

    fn write_error(&self, e: std::io::Error, what: &'static str) -> StoreError {
        if is_disk_full(&e) {
            let dir = self.t.dest.parent().unwrap_or(Path::new(".")).to_path_buf();
            let available_bytes = available_space(&dir).unwrap_or(0);
            let done_bytes: u64 = {
                let s = self.lock();
                (0..self.n_chunks).filter(|&i| s.done[i].is_some()).map(|i| self.range(i).1 - self.range(i).0).sum()
            };
            return StoreError::DiskFull { dir, need_bytes: self.t.size_bytes - done_bytes, available_bytes };
        }
        StoreError::Io { what, path: self.partial.to_path_buf(), source: e }
    }

    /// Walks the chunks in order, checks each against its journaled digest, refetches damaged
    /// ones, and returns the whole-file digest.
    fn verify(&self) -> Result<String> {
        let mut whole = WholeHasher::new(self.t.digest, self.t.size_bytes);
        let mut buf = vec![0u8; 1 << 20];
        for i in 0..self.n_chunks {
            let (start, end) = self.range(i);
            let mut fetches = 0u32;
            loop {
                let expected = {
                    let mut s = self.lock();
                    loop {
                        if let Some(e) = &s.error {
                            let _ = e;
                            return Err(StoreError::Cancelled);
                        }
                        if let Some(h) = &s.done[i] {
                            break h.clone();
                        }
                        s = self.changed.wait(s).unwrap_or_else(|p| p.into_inner());
                    }
                };
                let mut trial = whole.clone();
                let mut chunk = Sha256::new();
                let mut pos = start;
                let mut readable = true;
                while pos < end {
                    let n = buf.len().min((end - pos) as usize);
                    if read_exact_at(self.file, &mut buf[..n], pos).is_err() {
                        readable = false;
                        break;
                    }
                    chunk.update(&buf[..n]);
                    trial.update(&buf[..n]);
                    pos += n as u64;
                }
                if readable && hex(&chunk.finalize()) == expected {
                    whole = trial;
                    break;
                }
                fetches += 1;
                if fetches > 2 {
                    return Err(StoreError::Corruption {
                        partial: self.partial.to_path_buf(),
                        chunk_index: i,
                        offset: start,
                        end,
                        attempts: fetches,
                    });
                }
                self.obs.chunk_corrupted(self.t.repo_path, i, start, end - start);
                self.lock().done[i] = None;
                let h = self.fetch_chunk(i)?;
                self.lock().done[i] = Some(h);
            }
        }
        Ok(whole.finish_hex())
    }
}

#[cfg(unix)]
fn write_all_at(f: &File, bytes: &[u8], offset: u64) -> std::io::Result<()> {
    std::os::unix::fs::FileExt::write_all_at(f, bytes, offset)
}

#[cfg(unix)]
fn read_exact_at(f: &File, buf: &mut [u8], offset: u64) -> std::io::Result<()> {
    std::os::unix::fs::FileExt::read_exact_at(f, buf, offset)
}

#[cfg(windows)]
fn write_all_at(f: &File, mut bytes: &[u8], mut offset: u64) -> std::io::Result<()> {
    use std::os::windows::fs::FileExt;
    while !bytes.is_empty() {
        let n = f.seek_write(bytes, offset)?;
        bytes = &bytes[n..];
        offset += n as u64;
    }
    Ok(())
}

#[cfg(windows)]
fn read_exact_at(f: &File, mut buf: &mut [u8], mut offset: u64) -> std::io::Result<()> {
    use std::os::windows::fs::FileExt;
    while !buf.is_empty() {
        let n = f.seek_read(buf, offset)?;
        if n == 0 {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
        buf = &mut buf[n..];
        offset += n as u64;
    }
    Ok(())
}

/// Bytes available to an unprivileged writer on the file system holding `dir`.
#[cfg(unix)]
pub(crate) fn available_space(dir: &Path) -> Option<u64> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(dir.as_os_str().as_bytes()).ok()?;
    let mut st = std::mem::MaybeUninit::<libc::statvfs>::zeroed();
    // SAFETY: `c` is a NUL-terminated path that outlives the call, and `st` points to memory
    // large enough for a `statvfs`, which the call fills when it returns 0.
    let rc = unsafe { libc::statvfs(c.as_ptr(), st.as_mut_ptr()) };
    if rc != 0 {
        return None;
    }
    // SAFETY: statvfs returned 0, so it initialised the struct.
    let st = unsafe { st.assume_init() };
    // fsblkcnt_t and c_ulong are 32 bits wide on some targets.
    #[allow(clippy::unnecessary_cast)]
    Some((st.f_bavail as u64).saturating_mul(st.f_frsize as u64))
}

#[cfg(not(unix))]
pub(crate) fn available_space(_dir: &Path) -> Option<u64> {
    None
}

/// Takes an exclusive advisory lock on the partial, released by the kernel when the process
/// dies, so two pulls of one file into one store cannot interleave their writes.
#[cfg(unix)]
fn lock_exclusive(f: &File, path: &Path) -> Result<()> {
    use std::os::unix::io::AsRawFd;
    // SAFETY: the descriptor belongs to `f`, which is open for the duration of the call.
    let rc = unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
    if rc == 0 {
        return Ok(());
    }
    let e = std::io::Error::last_os_error();
    if e.raw_os_error() == Some(libc::EWOULDBLOCK) {
        return Err(StoreError::Busy { partial: path.to_path_buf() });
    }
    Err(StoreError::Io { what: "lock", path: path.to_path_buf(), source: e })
}

#[cfg(not(unix))]
fn lock_exclusive(_f: &File, _path: &Path) -> Result<()> {
    Ok(())
}

/// Makes a rename durable; best effort (not every file system lets a directory be synced).
fn sync_dir(dir: &Path) {
    if let Ok(d) = File::open(dir) {
        let _ = d.sync_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn torn_and_foreign_journals_are_not_trusted() {
        let dir = tempfile::tempdir().unwrap();
        let dest = dir.path().join("m.gguf");
        let d = Digest::Sha256("ab".repeat(32));
        let t = Target { repo_path: "m.gguf", dest: &dest, size_bytes: 10, digest: &d };
        let h = "cd".repeat(32);
        let jp = journal_path(&dest);
        std::fs::write(&jp, format!("{}0 {h}\n2 {h}\n1 {}", journal_header(&t, 4), &h[..10])).unwrap();
        let j = read_journal(&jp, &t).unwrap();
        assert_eq!(j.chunk_bytes, 4);
        assert_eq!(j.done, vec![Some(h.clone()), None, Some(h.clone())]);
        let other = Target { size_bytes: 11, ..t };
        assert!(read_journal(&jp, &other).is_none());
    }

    #[test]
    fn git_blob_digest_matches_git() {
        // `git hash-object` of an empty file and of "hello\n".
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("f");
        std::fs::write(&p, b"").unwrap();
        let empty = Digest::GitSha1(String::new());
        assert_eq!(hash_file(&p, &empty).unwrap(), "e69de29bb2d1d6434b8b29ae775ad8c2e48c5391");
        std::fs::write(&p, b"hello\n").unwrap();
        assert_eq!(hash_file(&p, &empty).unwrap(), "ce013625030ba8dba906f756967f9e9ca394464a");
    }
}
