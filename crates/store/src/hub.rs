//! Talking to a Hugging Face-compatible hub: file listings, file metadata, ranged GETs.
//!
//! The protocol, as `huggingface_hub` (`file_download.py`, `get_hf_file_metadata`) and the hub
//! implement it:
//! - a file is at `{endpoint}/{repo}/resolve/{revision}/{path}`;
//! - `HEAD` on it (redirects not followed) answers, for an LFS file, a 302 to the storage host
//!   carrying `X-Linked-Size` (bytes) and `X-Linked-Etag` (`"<sha256>"`); for a plain git file,
//!   a 200 with `Content-Length` and `ETag` (`"<git blob sha1>"`); a relative redirect means the
//!   repo was renamed and is followed; `X-Repo-Commit` names the commit;
//! - `GET {endpoint}/api/models/{repo}/tree/{revision}?recursive=true` lists files as JSON
//!   (`path`, `size`, `oid`, and `lfs: {oid: sha256, size}` for LFS files), paginated with a
//!   `Link: <...>; rel="next"` header;
//! - errors carry `X-Error-Code` (`RepoNotFound`, `RevisionNotFound`, `EntryNotFound`,
//!   `GatedRepo`) and `X-Error-Message`.
//!
//! The token goes only to the hub's own origin: the storage host gets signed URLs, and reqwest
//! drops `Authorization` on a cross-host redirect.

use crate::error::{Result, StoreError};
use reqwest::blocking::{Client, Response};
use reqwest::header::{HeaderMap, ACCEPT_ENCODING, CONTENT_LENGTH, ETAG, LINK, LOCATION, RANGE};
use reqwest::StatusCode;
use std::time::Duration;

/// The public Hugging Face hub.
pub const DEFAULT_ENDPOINT: &str = "https://huggingface.co";

/// A repo id, `owner/name` (or a bare `name`, which the hub also accepts for old repos).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct RepoId(String);

impl RepoId {
    /// Checks the form: one or two non-empty segments of letters, digits, `-`, `_`, `.`.
    ///
    /// # Errors
    /// [`StoreError::BadRepoId`].
    pub fn parse(s: &str) -> Result<RepoId> {
        let bad = || StoreError::BadRepoId { repo: s.to_string() };
        let parts: Vec<&str> = s.split('/').collect();
        if parts.is_empty() || parts.len() > 2 {
            return Err(bad());
        }
        for p in &parts {
            let ok = !p.is_empty()
                && *p != "."
                && *p != ".."
                && p.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'));
            if !ok {
                return Err(bad());
            }
        }
        Ok(RepoId(s.to_string()))
    }

    /// As [`RepoId::parse`], also taking a repo's web address (`https://huggingface.co/o/r`,
    /// `hf.co/o/r/tree/main`), which users paste from a browser.
    ///
    /// # Errors
    /// [`StoreError::BadRepoId`].
    pub fn from_user(s: &str) -> Result<RepoId> {
        let t = s.trim().trim_end_matches('/');
        let rest = t.strip_prefix("https://").or_else(|| t.strip_prefix("http://")).unwrap_or(t);
        let is_address = rest.len() != t.len() || rest.starts_with("huggingface.co/") || rest.starts_with("hf.co/");
        if !is_address {
            return RepoId::parse(t);
        }
        let segs: Vec<&str> = rest.split('/').skip(1).take(2).collect();
        RepoId::parse(&segs.join("/")).map_err(|_| StoreError::BadRepoId { repo: s.to_string() })
    }

    /// The id as written.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Display for RepoId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// A digest the hub publishes for a file, to verify the download against.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Digest {
    /// SHA-256 of the content, lower-case hex (LFS files: every GGUF on the hub).
    Sha256(String),
    /// Git's blob id: SHA-1 of `blob {size}\0` followed by the content (small non-LFS files).
    GitSha1(String),
}

impl Digest {
    /// `sha256` or `git-sha1`.
    pub fn algorithm(&self) -> &'static str {
        match self {
            Digest::Sha256(_) => "sha256",
            Digest::GitSha1(_) => "git-sha1",
        }
    }

    /// The hex digest.
    pub fn hex(&self) -> &str {
        match self {
            Digest::Sha256(h) | Digest::GitSha1(h) => h,
        }
    }

    /// Reads an ETag value: 64 hex digits are a sha256, 40 a git blob id; quotes and a weak
    /// `W/` prefix are dropped. Anything else (a storage host's own ETag) is not a digest.
    pub fn from_etag(etag: &str) -> Option<Digest> {
        let e = etag.trim();
        let e = e.strip_prefix("W/").unwrap_or(e);
        let e = e.trim_matches('"').to_ascii_lowercase();
        if !e.chars().all(|c| c.is_ascii_hexdigit()) {
            return None;
        }
        match e.len() {
            64 => Some(Digest::Sha256(e)),
            40 => Some(Digest::GitSha1(e)),
            _ => None,
        }
    }
}

/// One file of a repo listing.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RepoFile {
    /// Path in the repo (`Q4_K_M/model-00001-of-00002.gguf`).
    pub path: String,
    /// Size of the content (the LFS size for LFS files, not the pointer's).
    pub size_bytes: u64,
    /// The LFS sha256, when the file is in LFS.
    pub sha256: Option<String>,
}

/// What a `HEAD` on a file's resolve URL says.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FileMeta {
    /// Path in the repo.
    pub path: String,
    /// Content size.
    pub size_bytes: u64,
    /// The digest to verify against.
    pub digest: Digest,
    /// Where to GET the bytes (the storage host's URL for LFS files, else the resolve URL).
    pub download_url: String,
    /// The commit the revision resolved to, when the hub says.
    pub commit: Option<String>,
}

/// Settings of a [`Hub`] client.
#[derive(Clone, Debug)]
pub struct HubConfig {
    /// Base URL, without trailing slash (`https://huggingface.co`).
    pub endpoint: String,
    /// Bearer token for private and gated repos.
    pub token: Option<String>,
    /// Longest wait for a connection.
    pub connect_timeout: Duration,
    /// Longest wait for response headers or for the next bytes of a body.
    pub idle_timeout: Duration,
}

impl HubConfig {
    /// The default endpoint, no token, 20 s to connect, 60 s idle.
    pub fn new() -> HubConfig {
        HubConfig {
            endpoint: DEFAULT_ENDPOINT.to_string(),
            token: None,
            connect_timeout: Duration::from_secs(20),
            idle_timeout: Duration::from_secs(60),
        }
    }

    /// What `huggingface_hub` reads: `HF_ENDPOINT` (else the public hub), the token from
    /// `HF_TOKEN`, else from the file `$HF_TOKEN_PATH`, else `$HF_HOME/token` (default
    /// `~/.cache/huggingface/token`, where `huggingface-cli login` writes it).
    pub fn from_env() -> HubConfig {
        let mut c = HubConfig::new();
        if let Some(e) = std::env::var("HF_ENDPOINT").ok().filter(|e| !e.trim().is_empty()) {
            c.endpoint = e.trim().trim_end_matches('/').to_string();
        }
        c.token = token_from_env();
        c
    }
}

impl Default for HubConfig {
    fn default() -> Self {
        Self::new()
    }
}

fn token_from_env() -> Option<String> {
    if let Some(t) = std::env::var("HF_TOKEN").ok().filter(|t| !t.trim().is_empty()) {
        return Some(t.trim().to_string());
    }
    let path = match std::env::var_os("HF_TOKEN_PATH") {
        Some(p) => std::path::PathBuf::from(p),
        None => {
            let home = match std::env::var_os("HF_HOME") {
                Some(h) => std::path::PathBuf::from(h),
                None => crate::layout::xdg_cache_home()?.join("huggingface"),
            };
            home.join("token")
        }
    };
    let t = std::fs::read_to_string(path).ok()?;
    let t = t.trim();
    (!t.is_empty()).then(|| t.to_string())
}

/// A client for one hub endpoint.
#[derive(Clone, Debug)]
pub struct Hub {
    config: HubConfig,
    /// Follows redirects: for GETs of content and listings.
    client: Client,
    /// Follows none: `HEAD` must see the hub's own 302 and its `X-Linked-*` headers.
    head_client: Client,
}

/// How a ranged GET failed, as the retry loop needs to know it.
pub(crate) enum FetchFailure {
    /// Worth retrying: connection reset, timeout, 5xx, a body cut short.
    Transient(String),
    /// The URL stopped working in a way a fresh `HEAD` may fix (an expired signed URL).
    Expired(StoreError),
    /// Retrying cannot help.
    Permanent(StoreError),
}

impl Hub {
    /// A client with these settings.
    ///
    /// # Errors
    /// [`StoreError::BadResponse`] when the TLS stack cannot start (no usable roots).
    pub fn new(config: HubConfig) -> Result<Hub> {
        let build = |redirect: reqwest::redirect::Policy| {
            Client::builder()
                .user_agent(concat!("diskformer/", env!("CARGO_PKG_VERSION")))
                .connect_timeout(config.connect_timeout)
                .timeout(config.idle_timeout)
                .redirect(redirect)
                .build()
                .map_err(|e| StoreError::BadResponse {
                    url: config.endpoint.clone(),
                    why: format!("cannot start the HTTP client: {e}"),
                })
        };
        let client = build(reqwest::redirect::Policy::limited(10))?;
        let head_client = build(reqwest::redirect::Policy::none())?;
        Ok(Hub { config, client, head_client })
    }

    /// [`Hub::new`] with [`HubConfig::from_env`].
    ///
    /// # Errors
    /// As [`Hub::new`].
    pub fn from_env() -> Result<Hub> {
        Hub::new(HubConfig::from_env())
    }

    /// The endpoint.
    pub fn endpoint(&self) -> &str {
        &self.config.endpoint
    }

    /// Whether a token will be sent.
    pub fn has_token(&self) -> bool {
        self.config.token.is_some()
    }

    /// `{endpoint}/{repo}/resolve/{revision}/{path}`, each part percent-encoded.
    pub fn resolve_url(&self, repo: &RepoId, revision: &str, path: &str) -> String {
        format!("{}/{}/resolve/{}/{}", self.config.endpoint, repo, encode_segment(revision), encode_path(path))
    }

    fn same_origin(&self, url: &str) -> bool {
        let origin = |u: &str| -> Option<String> {
            let parsed = reqwest::Url::parse(u).ok()?;
            Some(format!("{}://{}:{}", parsed.scheme(), parsed.host_str()?, parsed.port_or_known_default()?))
        };
        origin(url).is_some() && origin(url) == origin(&self.config.endpoint)
    }

    fn authorize(&self, rb: reqwest::blocking::RequestBuilder, url: &str) -> reqwest::blocking::RequestBuilder {
        match &self.config.token {
            Some(t) if self.same_origin(url) => rb.bearer_auth(t),
            _ => rb,
        }
    }

    /// Every file of the repo at `revision`.
    ///
    /// # Errors
    /// [`StoreError::NoNetwork`], [`StoreError::NotFound`], [`StoreError::Unauthorized`],
    /// [`StoreError::Http`], or [`StoreError::BadResponse`] for a listing that does not parse.
    pub fn list_files(&self, repo: &RepoId, revision: &str) -> Result<Vec<RepoFile>> {
        #[derive(serde::Deserialize)]
        struct Lfs {
            oid: String,
            size: u64,
        }
        #[derive(serde::Deserialize)]
        struct Entry {
            #[serde(rename = "type")]
            kind: String,
            path: String,
            #[serde(default)]
            size: u64,
            #[serde(default)]
            lfs: Option<Lfs>,
        }
        let what = Subject { repo: Some((repo, revision)), file: None };
        let mut url =
            format!("{}/api/models/{}/tree/{}?recursive=true", self.config.endpoint, repo, encode_segment(revision));
        let mut files = Vec::new();
        // A listing of a few thousand pages would be a broken server, not a repo.
        for _page in 0..10_000 {
            let rb = self.authorize(self.client.get(&url), &url);
            let resp = rb.send().map_err(|e| network_error(&url, &e))?;
            let resp = check_status(resp, &url, &what, self.has_token())?;
            let next = next_link(resp.headers());
            let body = resp.text().map_err(|e| network_error(&url, &e))?;
            let entries: Vec<Entry> = serde_json::from_str(&body).map_err(|e| StoreError::BadResponse {
                url: url.clone(),
                why: format!("file listing is not the expected JSON: {e}"),
            })?;
            for e in entries {
                if e.kind != "file" {
                    continue;
                }
                let (size_bytes, sha256) = match e.lfs {
                    Some(l) => (l.size, Some(l.oid.to_ascii_lowercase())),
                    None => (e.size, None),
                };
                files.push(RepoFile { path: e.path, size_bytes, sha256 });
            }
            match next {
                Some(n) => url = absolutize(&url, &n),
                None => return Ok(files),
            }
        }
        Err(StoreError::BadResponse { url, why: "the listing does not end (more than 10000 pages)".into() })
    }

    /// Size, digest and download URL of one file, from a `HEAD` on its resolve URL.
    ///
    /// # Errors
    /// As [`Hub::list_files`], plus [`StoreError::NoChecksum`] when the hub publishes no
    /// digest and [`StoreError::BadResponse`] when it publishes no size.
    pub fn file_meta(&self, repo: &RepoId, revision: &str, path: &str) -> Result<FileMeta> {
        let what = Subject { repo: Some((repo, revision)), file: Some(path) };
        let resolve = self.resolve_url(repo, revision, path);
        let mut url = resolve.clone();
        for _hop in 0..6 {
            let rb = self.authorize(self.head_client.head(&url), &url).header(ACCEPT_ENCODING, "identity");
            let resp = rb.send().map_err(|e| network_error(&url, &e))?;
            let status = resp.status();
            let headers = resp.headers().clone();
            if status.is_redirection() {
                let location = header_str(&headers, LOCATION.as_str()).ok_or_else(|| StoreError::BadResponse {
                    url: url.clone(),
                    why: format!("HTTP {status} without Location"),
                })?;
                if location.starts_with('/') && !location.starts_with("//") {
                    // A renamed repo: the hub points at the new name on itself.
                    url = absolutize(&url, &location);
                    continue;
                }
                return meta_from_headers(path, &resolve, &headers, absolutize(&url, &location));
            }
            check_status(resp, &url, &what, self.has_token())?;
            return meta_from_headers(path, &resolve, &headers, url);
        }
        Err(StoreError::BadResponse { url, why: "more than 5 redirects within the hub".into() })
    }

    /// Starts a GET of bytes `start..end` (end exclusive) of `url`, checking that the answer is
    /// a 206 for exactly that range of a file of `total_bytes`.
    pub(crate) fn get_range(
        &self,
        url: &str,
        start: u64,
        end: u64,
        total_bytes: u64,
    ) -> Result<Response, FetchFailure> {
        let rb = self
            .authorize(self.client.get(url), url)
            .header(RANGE, format!("bytes={start}-{}", end - 1))
            .header(ACCEPT_ENCODING, "identity");
        let resp = rb.send().map_err(|e| transient_or_offline(url, &e))?;
        let status = resp.status();
        if status == StatusCode::PARTIAL_CONTENT {
            let range = header_str(resp.headers(), "content-range").unwrap_or_default();
            match parse_content_range(&range) {
                Some((s, e, total)) if s == start && e + 1 == end && total.is_none_or(|t| t == total_bytes) => {
                    return Ok(resp)
                }
                Some((_, _, Some(t))) if t != total_bytes => {
                    return Err(FetchFailure::Permanent(StoreError::SizeMismatch {
                        file: url.to_string(),
                        expected_bytes: total_bytes,
                        actual_bytes: t,
                        source_desc: "Content-Range".into(),
                    }))
                }
                _ => {
                    return Err(FetchFailure::Permanent(StoreError::BadResponse {
                        url: url.to_string(),
                        why: format!("asked for bytes {start}-{}, got Content-Range {range:?}", end - 1),
                    }))
                }
            }
        }
        if status.is_success() {
            return Err(FetchFailure::Permanent(StoreError::RangeNotSupported {
                url: url.to_string(),
                status: status.as_u16(),
                start,
            }));
        }
        if status.is_server_error() || status == StatusCode::TOO_MANY_REQUESTS || status == StatusCode::REQUEST_TIMEOUT
        {
            return Err(FetchFailure::Transient(format!("HTTP {status} from {url}")));
        }
        let err = check_status(resp, url, &Subject { repo: None, file: Some(url) }, self.has_token())
            .err()
            .unwrap_or_else(|| StoreError::Http { status: status.as_u16(), url: url.to_string(), body: String::new() });
        if !self.same_origin(url) && matches!(status.as_u16(), 401 | 403 | 404 | 410) {
            return Err(FetchFailure::Expired(err));
        }
        Err(FetchFailure::Permanent(err))
    }
}

fn meta_from_headers(path: &str, resolve: &str, headers: &HeaderMap, download_url: String) -> Result<FileMeta> {
    let size = header_str(headers, "x-linked-size").or_else(|| header_str(headers, CONTENT_LENGTH.as_str()));
    let size_bytes =
        size.as_deref().and_then(|s| s.trim().parse::<u64>().ok()).ok_or_else(|| StoreError::BadResponse {
            url: resolve.to_string(),
            why: format!("no usable X-Linked-Size or Content-Length for {path} (got {size:?})"),
        })?;
    let etag = header_str(headers, "x-linked-etag").or_else(|| header_str(headers, ETAG.as_str()));
    let digest = etag
        .as_deref()
        .and_then(Digest::from_etag)
        .ok_or_else(|| StoreError::NoChecksum { file: path.to_string(), url: resolve.to_string() })?;
    let commit = header_str(headers, "x-repo-commit");
    Ok(FileMeta { path: path.to_string(), size_bytes, digest, download_url, commit })
}

fn header_str(h: &HeaderMap, name: &str) -> Option<String> {
    h.get(name).and_then(|v| v.to_str().ok()).map(|s| s.to_string())
}

/// `bytes START-END/TOTAL` (TOTAL may be `*`).
fn parse_content_range(v: &str) -> Option<(u64, u64, Option<u64>)> {
    let rest = v.trim().strip_prefix("bytes ")?;
    let (range, total) = rest.split_once('/')?;
    let (s, e) = range.split_once('-')?;
    let total = if total.trim() == "*" { None } else { Some(total.trim().parse().ok()?) };
    Some((s.trim().parse().ok()?, e.trim().parse().ok()?, total))
}

/// The `rel="next"` target of a `Link` header.
fn next_link(h: &HeaderMap) -> Option<String> {
    let link = header_str(h, LINK.as_str())?;
    link.split(',').find_map(|part| {
        let (target, params) = part.split_once(';')?;
        params
            .split(';')
            .any(|p| p.trim().replace(' ', "") == "rel=\"next\"" || p.trim() == "rel=next")
            .then(|| target.trim().trim_start_matches('<').trim_end_matches('>').to_string())
    })
}

fn absolutize(base: &str, target: &str) -> String {
    match reqwest::Url::parse(base).and_then(|b| b.join(target)) {
        Ok(u) => u.to_string(),
        Err(_) => target.to_string(),
    }
}

fn network_error(url: &str, e: &reqwest::Error) -> StoreError {
    StoreError::NoNetwork { url: url.to_string(), reason: error_chain(e) }
}

fn transient_or_offline(url: &str, e: &reqwest::Error) -> FetchFailure {
    FetchFailure::Transient(format!("{} ({url})", error_chain(e)))
}

/// reqwest's top-level message is often just "error sending request for url (...)", which the
/// caller already says; the causes say why.
fn error_chain(e: &(dyn std::error::Error + 'static)) -> String {
    let top = e.to_string();
    let mut msg = if top.starts_with("error sending request") && e.source().is_some() { String::new() } else { top };
    let mut cur = e.source();
    while let Some(c) = cur {
        let s = c.to_string();
        if msg.is_empty() {
            msg = s;
        } else if !msg.contains(&s) {
            msg.push_str(": ");
            msg.push_str(&s);
        }
        cur = c.source();
    }
    msg
}

/// What a request was for, to name it in errors.
struct Subject<'a> {
    repo: Option<(&'a RepoId, &'a str)>,
    file: Option<&'a str>,
}

impl Subject<'_> {
    /// The thing the hub says is missing or refused, as precisely as its error code allows.
    fn describe(&self, code: &str) -> String {
        match (self.repo, self.file, code) {
            (Some((r, _)), _, "RepoNotFound" | "GatedRepo") => format!("repo {r}"),
            (Some((r, rev)), _, "RevisionNotFound") => format!("revision {rev} of {r}"),
            (Some((r, rev)), Some(f), _) => format!("file {f} in {r} at revision {rev}"),
            (Some((r, rev)), None, _) => format!("repo {r} at revision {rev}"),
            (None, Some(f), _) => format!("download URL {f}"),
            (None, None, _) => "the request".to_string(),
        }
    }
}

/// Maps 4xx/5xx to the store's errors; passes successes through.
fn check_status(resp: Response, url: &str, what: &Subject<'_>, token_sent: bool) -> Result<Response> {
    let status = resp.status();
    if status.is_success() {
        return Ok(resp);
    }
    let code = header_str(resp.headers(), "x-error-code").unwrap_or_default();
    let message = header_str(resp.headers(), "x-error-message").unwrap_or_default();
    let subject = what.describe(&code);
    match status.as_u16() {
        404 => {
            let hint = if !token_sent && code == "RepoNotFound" {
                "; if the repo is private, set HF_TOKEN".to_string()
            } else if !message.is_empty() {
                format!("; the hub says: {message}")
            } else {
                String::new()
            };
            Err(StoreError::NotFound { what: subject, url: url.to_string(), hint })
        }
        401 | 403 => {
            let advice = if code == "GatedRepo" {
                "the repo is gated: accept its terms on the hub's page for it, then set HF_TOKEN to a token of that account".to_string()
            } else if token_sent {
                "the token in HF_TOKEN was refused or has no access to this repo (or the repo does not exist)"
                    .to_string()
            } else {
                "set HF_TOKEN to a token with access (the repo may be private, gated, or not exist)".to_string()
            };
            Err(StoreError::Unauthorized { what: subject, status: status.as_u16(), url: url.to_string(), advice })
        }
        s => {
            let mut body = resp.text().unwrap_or_default();
            if body.len() > 200 {
                let mut cut = 200;
                while !body.is_char_boundary(cut) {
                    cut -= 1;
                }
                body.truncate(cut);
            }
            let body = if body.trim().is_empty() { message } else { body.trim().to_string() };
            Err(StoreError::Http { status: s, url: url.to_string(), body })
        }
    }
}

/// Percent-encodes one path segment (RFC 3986 unreserved characters stay).
pub(crate) fn encode_segment(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~') {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

fn encode_path(p: &str) -> String {
    p.split('/').map(encode_segment).collect::<Vec<_>>().join("/")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn etags_are_read_as_hub_digests() {
        let sha = "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855";
        assert_eq!(Digest::from_etag(&format!("\"{sha}\"")), Some(Digest::Sha256(sha.into())));
        assert_eq!(Digest::from_etag(&format!("W/\"{}\"", sha.to_uppercase())), Some(Digest::Sha256(sha.into())));
        let git = "e69de29bb2d1d6434b8b29ae775ad8c2e48c5391";
        assert_eq!(Digest::from_etag(&format!("\"{git}\"")), Some(Digest::GitSha1(git.into())));
        // A storage host's multipart ETag is not a content digest.
        assert_eq!(Digest::from_etag("\"9b2cf535f27731c974343645a3985328-12\""), None);
    }

    #[test]
    fn content_range_and_link_headers_parse() {
        assert_eq!(parse_content_range("bytes 0-99/1000"), Some((0, 99, Some(1000))));
        assert_eq!(parse_content_range("bytes 5-9/*"), Some((5, 9, None)));
        assert_eq!(parse_content_range("bytes */1000"), None);
        let mut h = HeaderMap::new();
        h.insert(LINK, "<https://hub/api/models/a/b/tree/main?cursor=xyz>; rel=\"next\"".parse().unwrap());
        assert_eq!(next_link(&h).as_deref(), Some("https://hub/api/models/a/b/tree/main?cursor=xyz"));
    }

    #[test]
    fn repo_ids_and_urls() {
        assert!(RepoId::parse("Qwen/Qwen3-0.6B-GGUF").is_ok());
        assert!(RepoId::parse("gpt2").is_ok());
        for bad in ["", "a/b/c", "a//b", "../x", "a/b c", "a/.."] {
            assert!(RepoId::parse(bad).is_err(), "{bad:?}");
        }
        for url in
            ["https://huggingface.co/Qwen/Qwen3-8B-GGUF", "hf.co/Qwen/Qwen3-8B-GGUF/tree/main", "Qwen/Qwen3-8B-GGUF"]
        {
            assert_eq!(RepoId::from_user(url).unwrap().as_str(), "Qwen/Qwen3-8B-GGUF", "{url}");
        }
        let hub = Hub::new(HubConfig { endpoint: "http://127.0.0.1:9".into(), ..HubConfig::new() }).unwrap();
        let repo = RepoId::parse("o/r").unwrap();
        assert_eq!(
            hub.resolve_url(&repo, "refs/pr/1", "Q4 K/m.gguf"),
            "http://127.0.0.1:9/o/r/resolve/refs%2Fpr%2F1/Q4%20K/m.gguf"
        );
    }
}
