//! Per-model options from a presets file (`diskformer serve --models-preset FILE`), in
//! llama-server's INI form: a `[*]` section applies to every model, a `[NAME]` section to the
//! model of that name; keys are `serve`'s long flag names without the dashes.
//!
//! ```ini
//! [*]
//! ctx-size = 2048
//!
//! [qwen3-30b-a3b-q4_k_m]
//! ram-budget = 8G
//! cache-policy = lru
//! prefetch = true
//! ```
//!
//! Order: the command line's values, then `[*]`, then the model's section (llama-server lets
//! the command line win instead; here a preset exists to differ from the command line). A
//! section may only name a model of the folder (a name never becomes a path), and every key
//! and value is checked when the file is read, so a typo stops the server at start with the
//! line number rather than being ignored.

use crate::engine::EngineOptions;
use std::collections::BTreeMap;

/// A presets file that cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PresetError {
    /// A line that is neither a section, a `key = value` pair, a comment nor blank.
    #[error("presets line {line}: {text:?} is not `[section]` or `key = value`")]
    Syntax {
        /// 1-based line number.
        line: usize,
        /// The line.
        text: String,
    },
    /// A section naming no model of the folder.
    #[error("presets line {line}: [{name}] is not a model of the folder (models: {known})")]
    UnknownModel {
        /// 1-based line number.
        line: usize,
        /// The section name.
        name: String,
        /// The models there are, comma-separated.
        known: String,
    },
    /// A key before any section.
    #[error("presets line {line}: `{key}` comes before any [section]")]
    NoSection {
        /// 1-based line number.
        line: usize,
        /// The key.
        key: String,
    },
    /// A key that is not a per-model option.
    #[error("presets line {line}: `{key}` is not a per-model option (known: {known})")]
    UnknownKey {
        /// 1-based line number.
        line: usize,
        /// The key.
        key: String,
        /// The keys there are.
        known: &'static str,
    },
    /// A value the key does not take.
    #[error("presets line {line}: `{key} = {value}`: {why}")]
    BadValue {
        /// 1-based line number.
        line: usize,
        /// The key.
        key: String,
        /// The value.
        value: String,
        /// What the key takes.
        why: String,
    },
}

/// The keys a preset may set.
pub const KEYS: &str = "ctx-size (c), parallel, queue, device, read-ahead, no-read-ahead, ram-budget, gpu-budget, \
                        moe-miss, cache-policy, prefetch, direct-io, stats";

fn parse_bool(v: &str) -> Result<bool, String> {
    match v.to_ascii_lowercase().as_str() {
        "true" | "on" | "yes" | "1" => Ok(true),
        "false" | "off" | "no" | "0" => Ok(false),
        _ => Err("takes true or false".into()),
    }
}

fn parse_count(v: &str) -> Result<u64, String> {
    v.parse::<u64>().map_err(|_| "takes a whole number".into())
}

/// Sets one key on `o`; the error says what the key takes.
fn apply(o: &mut EngineOptions, key: &str, value: &str) -> Result<(), Option<String>> {
    match key {
        "ctx-size" | "c" => o.n_ctx = parse_count(value)?,
        "parallel" => o.parallel = (parse_count(value)? as usize).max(1),
        "queue" => o.queue_max = (parse_count(value)? as usize).max(1),
        "device" => {
            o.backend = match value.to_ascii_lowercase().as_str() {
                "auto" => None,
                "cpu" => Some(plan::BackendKind::Cpu),
                "gpu" => Some(plan::BackendKind::Gpu),
                _ => return Err(Some("takes auto, cpu or gpu".into())),
            }
        }
        "read-ahead" => o.read_ahead = parse_bool(value)?,
        "no-read-ahead" => o.read_ahead = !parse_bool(value)?,
        "ram-budget" => {
            o.ram_budget_bytes = match value.to_ascii_lowercase().as_str() {
                "none" | "off" => None,
                _ => Some(plan::parse_bytes(value).map_err(|e| format!("{e}; or none"))?),
            }
        }
        "gpu-budget" => {
            o.gpu_budget_bytes = match value.to_ascii_lowercase().as_str() {
                "none" | "off" => None,
                _ => Some(plan::parse_bytes(value).map_err(|e| format!("{e}; or none"))?),
            }
        }
        "moe-miss" => {
            o.moe_miss = match value.to_ascii_lowercase().as_str() {
                "default" => None,
                "upload" => Some(plan::TierMiss::Upload),
                "cpu" => Some(plan::TierMiss::Cpu),
                "auto" => Some(plan::TierMiss::Auto),
                "host" => Some(plan::TierMiss::Host),
                "split" => Some(plan::TierMiss::Split),
                _ => return Err(Some("takes upload, cpu, auto, host, split or default".into())),
            }
        }
        "cache-policy" => {
            o.cache_policy = match value.to_ascii_lowercase().as_str() {
                "lru" => pager::CachePolicy::Lru,
                "lfu" => pager::CachePolicy::Lfu,
                _ => return Err(Some("takes lru or lfu".into())),
            }
        }
        "prefetch" => o.prefetch = parse_bool(value)?,
        "direct-io" => o.direct_io = parse_bool(value)?,
        "stats" => o.stats = parse_bool(value)?,
        _ => return Err(None),
    }
    Ok(())
}

/// Each model's options: `base` (the command line's) with the file's `[*]` then `[NAME]`
/// assignments applied, for every name in `names`.
///
/// # Errors
/// [`PresetError`] for the first bad line.
pub fn resolve(
    text: &str,
    base: &EngineOptions,
    names: &[String],
) -> Result<BTreeMap<String, EngineOptions>, PresetError> {
    // (section, key, value, line); section None is `[*]`.
    let mut assignments: Vec<(Option<String>, String, String, usize)> = Vec::new();
    let mut section: Option<Option<String>> = None;
    for (i, raw) in text.lines().enumerate() {
        let line = i + 1;
        let t = raw.trim();
        if t.is_empty() || t.starts_with('#') || t.starts_with(';') {
            continue;
        }
        if let Some(name) = t.strip_prefix('[').and_then(|r| r.strip_suffix(']')) {
            let name = name.trim();
            if name == "*" {
                section = Some(None);
            } else if names.iter().any(|n| n == name) {
                section = Some(Some(name.to_string()));
            } else {
                return Err(PresetError::UnknownModel { line, name: name.to_string(), known: names.join(", ") });
            }
            continue;
        }
        let Some((k, v)) = t.split_once('=') else {
            return Err(PresetError::Syntax { line, text: raw.to_string() });
        };
        let (key, value) = (k.trim().to_string(), v.trim().trim_matches('"').to_string());
        let Some(sec) = &section else { return Err(PresetError::NoSection { line, key }) };
        // Checked here, on a scratch copy, so a bad line fails at start even for a model
        // never loaded.
        if let Err(why) = apply(&mut base.clone(), &key, &value) {
            return Err(match why {
                None => PresetError::UnknownKey { line, key, known: KEYS },
                Some(why) => PresetError::BadValue { line, key, value, why },
            });
        }
        assignments.push((sec.clone(), key, value, line));
    }
    let mut out = BTreeMap::new();
    for name in names {
        let mut o = base.clone();
        let global = assignments.iter().filter(|a| a.0.is_none());
        let own = assignments.iter().filter(|a| a.0.as_deref() == Some(name.as_str()));
        for (_, key, value, _) in global.chain(own) {
            // Every assignment was checked above.
            let _ = apply(&mut o, key, value);
        }
        out.insert(name.clone(), o);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names() -> Vec<String> {
        vec!["a".to_string(), "b-moe".to_string()]
    }

    #[test]
    fn global_then_model_sections_override_the_command_line() {
        let text = "# comment\n[*]\nctx-size = 1024\nparallel=2\n\n[b-moe]\nram-budget = 64M\ncache-policy = lru\n\
                    prefetch = true\nctx-size = 512\n; also a comment\n";
        let base = EngineOptions { n_ctx: 4096, stats: true, ..Default::default() };
        let m = resolve(text, &base, &names()).unwrap();
        let a = &m["a"];
        assert_eq!((a.n_ctx, a.parallel, a.ram_budget_bytes, a.stats), (1024, 2, None, true));
        let b = &m["b-moe"];
        assert_eq!((b.n_ctx, b.parallel, b.ram_budget_bytes), (512, 2, Some(64 << 20)));
        assert_eq!((b.cache_policy, b.prefetch, b.direct_io), (pager::CachePolicy::Lru, true, false));
    }

    #[test]
    fn bad_lines_name_their_line_and_what_is_wrong() {
        let base = EngineOptions::default();
        let err = |t: &str| resolve(t, &base, &names()).unwrap_err();
        match err("[*]\nram-budget = lots\n") {
            PresetError::BadValue { line: 2, key, value, why } => {
                assert_eq!((key.as_str(), value.as_str()), ("ram-budget", "lots"));
                assert!(why.contains("lots") && why.ends_with("or none"), "{why}");
            }
            other => panic!("{other:?}"),
        }
        assert!(matches!(err("[../etc/passwd]\n"), PresetError::UnknownModel { line: 1, .. }));
        assert!(matches!(err("[a]\nthreads = 4\n"), PresetError::UnknownKey { line: 2, .. }));
        assert!(matches!(err("ctx-size = 4\n"), PresetError::NoSection { line: 1, .. }));
        assert!(matches!(err("[a]\njust words\n"), PresetError::Syntax { line: 2, .. }));
        assert!(matches!(err("[a]\ncache-policy = mru\n"), PresetError::BadValue { line: 2, .. }));
        assert!(matches!(err("[a]\nprefetch = maybe\n"), PresetError::BadValue { line: 2, .. }));
    }
}
