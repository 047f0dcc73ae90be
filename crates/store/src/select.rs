//! Which files of a repo to pull: by file name, by quant name, or the default; split sets whole.

use crate::error::{Result, StoreError};
use crate::hub::RepoFile;
use std::path::Path;

/// What the user asked for beside the repo.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Want {
    /// Nothing: the repo's only GGUF, else its Q4_K_M.
    Default,
    /// A quant name (`Q4_K_M`, `UD-Q4_K_XL`), matched against file names.
    Quant(String),
    /// A file path in the repo; a split part brings its whole set.
    File(String),
}

impl Want {
    /// A `.gguf` name or anything with a `/` is a file; another word is a quant.
    pub fn parse(arg: Option<&str>) -> Want {
        match arg.map(str::trim).filter(|a| !a.is_empty()) {
            None => Want::Default,
            Some(a) if a.to_ascii_lowercase().ends_with(".gguf") || a.contains('/') => Want::File(a.to_string()),
            Some(a) => Want::Quant(a.to_string()),
        }
    }
}

/// The files to pull and the tag the model gets (`owner/repo:TAG`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Selection {
    /// Paths in the repo, in part order.
    pub paths: Vec<String>,
    /// The tag: the quant name found in the file name, else the file's stem.
    pub tag: String,
}

/// The quant used when only a repo is given and it has several GGUFs (as llama.cpp's `-hf`).
pub const DEFAULT_QUANT: &str = "Q4_K_M";

/// A GGUF file or a whole split set, named by its first part.
#[derive(Clone, Debug)]
struct GgufSet {
    paths: Vec<String>,
}

impl GgufSet {
    fn first(&self) -> &str {
        &self.paths[0]
    }
    fn is_projector(&self) -> bool {
        file_name(self.first()).to_ascii_lowercase().starts_with("mmproj")
    }
}

fn file_name(p: &str) -> &str {
    p.rsplit('/').next().unwrap_or(p)
}

/// The parts of the split set `path` belongs to (all of them, in order), or just `path`.
pub fn expand_split(path: &str) -> Vec<String> {
    match gguf::split_name_parts(Path::new(path)) {
        Some((prefix, count)) if count > 1 => {
            let dir = match path.rsplit_once('/') {
                Some((d, _)) => format!("{d}/"),
                None => String::new(),
            };
            let stem = prefix.rsplit('/').next().unwrap_or(&prefix).to_string();
            (0..count).map(|no| format!("{dir}{stem}-{:05}-of-{count:05}.gguf", no + 1)).collect()
        }
        _ => vec![path.to_string()],
    }
}

fn group_sets(files: &[RepoFile]) -> Vec<GgufSet> {
    let mut sets: Vec<GgufSet> = Vec::new();
    let mut seen = std::collections::HashSet::new();
    let mut paths: Vec<&str> =
        files.iter().map(|f| f.path.as_str()).filter(|p| p.to_ascii_lowercase().ends_with(".gguf")).collect();
    paths.sort();
    for p in paths {
        if seen.contains(p) {
            continue;
        }
        let parts = expand_split(p);
        for q in &parts {
            seen.insert(q.clone());
        }
        sets.push(GgufSet { paths: parts });
    }
    sets
}

/// True when `quant` occurs in `path` as a whole token: preceded by the start or one of
/// `-._/`, followed by the end or one of `-./` (so `Q4_K` does not match `Q4_K_M`).
pub fn path_has_quant(path: &str, quant: &str) -> bool {
    let hay = path.to_ascii_lowercase();
    let needle = quant.to_ascii_lowercase();
    if needle.is_empty() {
        return false;
    }
    let bytes = hay.as_bytes();
    let mut from = 0;
    while let Some(off) = hay[from..].find(&needle) {
        let at = from + off;
        let end = at + needle.len();
        let before_ok = at == 0 || matches!(bytes[at - 1], b'-' | b'.' | b'_' | b'/');
        let after_ok = end == bytes.len() || matches!(bytes[end], b'-' | b'.' | b'/');
        if before_ok && after_ok {
            return true;
        }
        from = at + 1;
    }
    false
}

/// The quant name in a file name: the last `-`/`.`-separated token that looks like one
/// (`Q4_0`, `Q4_K_XL`, `IQ3_M`, `TQ1_0`, `F16`, `BF16`, `F32`, `MXFP4`), upper-cased.
pub fn quant_in_name(path: &str) -> Option<String> {
    let name = file_name(path);
    let stem = name.strip_suffix(".gguf").or_else(|| name.strip_suffix(".GGUF")).unwrap_or(name);
    stem.split(['-', '.']).rev().map(|t| t.to_ascii_uppercase()).find(|t| {
        let b = t.as_bytes();
        let q_digit = |i: usize| b.len() > i + 1 && b[i] == b'Q' && b[i + 1].is_ascii_digit();
        q_digit(0)
            || ((t.starts_with("IQ") || t.starts_with("TQ")) && b.len() > 2 && b[2].is_ascii_digit())
            || matches!(t.as_str(), "F16" | "F32" | "BF16" | "F64")
            || t.starts_with("MXFP4")
    })
}

/// A tag for a file: its quant name, else [`stem_tag`].
pub fn tag_for(path: &str) -> String {
    quant_in_name(path).unwrap_or_else(|| stem_tag(path))
}

/// The file's stem (a split set's prefix for a split part), with characters a store name
/// cannot hold replaced by `_`.
pub fn stem_tag(path: &str) -> String {
    let p = Path::new(path);
    let stem = match gguf::split_name_parts(p) {
        Some((prefix, _)) => prefix.rsplit('/').next().unwrap_or(&prefix).to_string(),
        None => p.file_stem().and_then(|s| s.to_str()).unwrap_or("model").to_string(),
    };
    let t: String =
        stem.chars().map(|c| if c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.') { c } else { '_' }).collect();
    let t = t.trim_start_matches('.');
    if t.is_empty() {
        "model".to_string()
    } else {
        t.to_string()
    }
}

/// Picks the files for `want` among a repo listing.
///
/// # Errors
/// [`StoreError::NoGguf`], [`StoreError::NoMatchingQuant`] (listing the repo's quants),
/// [`StoreError::AmbiguousQuant`] (listing the candidates).
pub fn select(repo: &str, revision: &str, files: &[RepoFile], want: &Want) -> Result<Selection> {
    if let Want::File(f) = want {
        let f = f.trim_start_matches('/');
        return Ok(Selection { paths: expand_split(f), tag: tag_for(f) });
    }
    let sets = group_sets(files);
    if sets.is_empty() {
        return Err(StoreError::NoGguf { repo: repo.to_string(), revision: revision.to_string() });
    }
    let models: Vec<&GgufSet> = sets.iter().filter(|s| !s.is_projector()).collect();
    let pick = |matching: Vec<&GgufSet>, quant: &str| -> Result<Selection> {
        match matching.as_slice() {
            [one] => Ok(Selection { paths: one.paths.clone(), tag: tag_for_quant(one.first(), quant) }),
            [] => Err(StoreError::NoMatchingQuant {
                repo: repo.to_string(),
                quant: quant.to_string(),
                available: available(&sets),
            }),
            many => Err(StoreError::AmbiguousQuant {
                repo: repo.to_string(),
                for_quant: format!(" matching {quant:?}"),
                candidates: many.iter().map(|s| s.first().to_string()).collect(),
            }),
        }
    };
    match want {
        Want::Quant(q) => {
            let pool: Vec<&GgufSet> =
                if q.to_ascii_lowercase().starts_with("mmproj") { sets.iter().collect() } else { models };
            pick(pool.into_iter().filter(|s| path_has_quant(s.first(), q)).collect(), q)
        }
        Want::Default => {
            if let [one] = models.as_slice() {
                return Ok(Selection { paths: one.paths.clone(), tag: tag_for(one.first()) });
            }
            let q4: Vec<&GgufSet> =
                models.iter().copied().filter(|s| path_has_quant(s.first(), DEFAULT_QUANT)).collect();
            if q4.len() == 1 {
                return pick(q4, DEFAULT_QUANT);
            }
            Err(StoreError::AmbiguousQuant {
                repo: repo.to_string(),
                for_quant: String::new(),
                candidates: models.iter().map(|s| s.first().to_string()).collect(),
            })
        }
        Want::File(_) => unreachable!("handled above"),
    }
}

/// The tag for a set chosen by quant: the quant as the user wrote it, upper-cased, when the
/// file name holds it; this keeps `UD-Q4_K_XL` whole.
fn tag_for_quant(first: &str, quant: &str) -> String {
    if path_has_quant(first, quant) && crate::layout::check_name(&format!("x:{quant}")).is_ok() {
        quant.to_ascii_uppercase()
    } else {
        tag_for(first)
    }
}

fn available(sets: &[GgufSet]) -> Vec<String> {
    let mut v: Vec<String> =
        sets.iter().map(|s| quant_in_name(s.first()).unwrap_or_else(|| s.first().to_string())).collect();
    v.sort();
    v.dedup();
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    fn listing(paths: &[&str]) -> Vec<RepoFile> {
        paths.iter().map(|p| RepoFile { path: p.to_string(), size_bytes: 1, sha256: None }).collect()
    }

    // The file layout of unsloth/Qwen3-30B-A3B-GGUF and Qwen/Qwen3-8B-GGUF style repos.
    const REPO: &[&str] = &[
        "README.md",
        "Qwen3-30B-A3B-Q4_K_M.gguf",
        "Qwen3-30B-A3B-Q4_K_S.gguf",
        "Qwen3-30B-A3B-UD-Q4_K_XL.gguf",
        "Qwen3-30B-A3B-Q8_0.gguf",
        "BF16/Qwen3-30B-A3B-BF16-00001-of-00002.gguf",
        "BF16/Qwen3-30B-A3B-BF16-00002-of-00002.gguf",
        "mmproj-F16.gguf",
        "Qwen3-30B-A3B-F16.gguf",
    ];

    #[test]
    fn quant_picks_one_set_and_split_sets_come_whole() {
        let files = listing(REPO);
        let s = select("o/r", "main", &files, &Want::Quant("q4_k_m".into())).unwrap();
        assert_eq!(s.paths, vec!["Qwen3-30B-A3B-Q4_K_M.gguf"]);
        assert_eq!(s.tag, "Q4_K_M");
        let s = select("o/r", "main", &files, &Want::Quant("BF16".into())).unwrap();
        assert_eq!(
            s.paths,
            vec!["BF16/Qwen3-30B-A3B-BF16-00001-of-00002.gguf", "BF16/Qwen3-30B-A3B-BF16-00002-of-00002.gguf"]
        );
        let s = select("o/r", "main", &files, &Want::Quant("UD-Q4_K_XL".into())).unwrap();
        assert_eq!((s.paths.len(), s.tag.as_str()), (1, "UD-Q4_K_XL"));
        // F16 matches the model, not the projector.
        let s = select("o/r", "main", &files, &Want::Quant("F16".into())).unwrap();
        assert_eq!(s.paths, vec!["Qwen3-30B-A3B-F16.gguf"]);
        let s = select("o/r", "main", &files, &Want::Default).unwrap();
        assert_eq!(s.paths, vec!["Qwen3-30B-A3B-Q4_K_M.gguf"]);
        let s =
            select("o/r", "main", &files, &Want::File("BF16/Qwen3-30B-A3B-BF16-00002-of-00002.gguf".into())).unwrap();
        assert_eq!(s.paths.len(), 2);
        assert_eq!(s.tag, "BF16");
    }

    #[test]
    fn misses_and_ambiguity_list_the_choices() {
        let files = listing(REPO);
        match select("o/r", "main", &files, &Want::Quant("Q4_K".into())) {
            Err(StoreError::NoMatchingQuant { available, .. }) => {
                assert!(
                    available.contains(&"Q4_K_M".to_string()) && available.contains(&"BF16".to_string()),
                    "{available:?}"
                )
            }
            other => panic!("{other:?}"),
        }
        let files = listing(&["a-Q8_0.gguf", "b-Q8_0.gguf"]);
        assert!(matches!(
            select("o/r", "main", &files, &Want::Quant("Q8_0".into())),
            Err(StoreError::AmbiguousQuant { .. })
        ));
        assert!(matches!(select("o/r", "main", &files, &Want::Default), Err(StoreError::AmbiguousQuant { .. })));
        assert!(matches!(
            select("o/r", "main", &listing(&["README.md"]), &Want::Default),
            Err(StoreError::NoGguf { .. })
        ));
    }

    #[test]
    fn wants_and_tags() {
        assert_eq!(Want::parse(None), Want::Default);
        assert_eq!(Want::parse(Some("Q4_K_M")), Want::Quant("Q4_K_M".into()));
        assert_eq!(Want::parse(Some("x/m.gguf")), Want::File("x/m.gguf".into()));
        assert_eq!(quant_in_name("Llama-3.2-1B-Instruct-IQ3_M.gguf").as_deref(), Some("IQ3_M"));
        assert_eq!(quant_in_name("model.q8_0.gguf").as_deref(), Some("Q8_0"));
        assert_eq!(quant_in_name("gpt-oss-20b-mxfp4.gguf").as_deref(), Some("MXFP4"));
        assert_eq!(quant_in_name("tiny.gguf"), None);
        assert_eq!(tag_for("dir/my model-00001-of-00003.gguf"), "my_model");
    }
}
