//! [`ChatTemplate`]: `tokenizer.chat_template` rendered as HF `transformers` renders it.
//!
//! transformers compiles the template with Jinja2 (`trim_blocks`, `lstrip_blocks`, the loop-controls
//! extension) and adds `raise_exception`, `strftime_now` and its own `tojson` (Python's `json.dumps`,
//! so `", "`/`": "` separators, no HTML escaping, non-ASCII kept). We use minijinja with the same
//! settings, the pycompat method table (`.strip()`, `.split()`, `.startswith()`, `.items()`, ...)
//! and ports of those three helpers; the tests compare against transformers' output.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use minijinja::value::{Kwargs, ValueKind};
use minijinja::{Environment, Error, ErrorKind, Value};
use serde::Serialize;

use crate::TemplateError;

const TEMPLATE_NAME: &str = "chat_template";

/// One chat message, as OpenAI-style APIs and HF templates spell it.
#[derive(Clone, Debug, Default, Serialize, PartialEq)]
pub struct ChatMessage {
    /// `system`, `user`, `assistant`, `tool`, ...
    pub role: String,
    /// A string, or a list of content parts (`[{"type": "text", "text": ...}]`).
    pub content: serde_json::Value,
    /// Tool calls of an assistant message (`[{"type": "function", "function": {...}}]`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<serde_json::Value>,
    /// The call a `tool` message answers.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
    /// The name of the tool or participant.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// The reasoning ("thinking") of an assistant message.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reasoning_content: Option<String>,
}

impl ChatMessage {
    /// A message with text content.
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> ChatMessage {
        ChatMessage { role: role.into(), content: serde_json::Value::String(content.into()), ..Default::default() }
    }
}

/// Options of one rendering.
#[derive(Clone, Debug, Default)]
pub struct ChatOptions {
    /// End with the header of an assistant turn, so that the model answers.
    pub add_generation_prompt: bool,
    /// Passed as `enable_thinking` when set (Qwen3-style templates read it).
    pub enable_thinking: Option<bool>,
    /// Tool definitions (a JSON list), passed as `tools`.
    pub tools: Option<serde_json::Value>,
    /// More template variables; they override `bos_token`/`eos_token` as kwargs do in transformers.
    pub extra: BTreeMap<String, serde_json::Value>,
}

/// A compiled chat template.
pub struct ChatTemplate {
    env: Environment<'static>,
    bos_token: String,
    eos_token: String,
    reads_tools: bool,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate").field("bos_token", &self.bos_token).field("eos_token", &self.eos_token).finish()
    }
}

/// The text of the token whose id is stored under `id_key`, if both exist.
fn token_text(md: &gguf::Metadata, id_key: &str) -> Result<Option<String>, TemplateError> {
    let Some(id) = md.u32_opt(id_key)? else { return Ok(None) };
    let Some(tokens) = md.array_opt("tokenizer.ggml.tokens")? else { return Ok(None) };
    Ok(tokens.get(id as usize).and_then(|v| v.as_str()).map(str::to_string))
}

impl ChatTemplate {
    /// The template in `tokenizer.chat_template`, with the model's BOS/EOS texts; `None` when the
    /// GGUF has no template.
    ///
    /// # Errors
    /// A mistyped key, or a template that does not compile.
    pub fn from_gguf(md: &gguf::Metadata) -> Result<Option<ChatTemplate>, TemplateError> {
        let Some(source) = md.str_opt("tokenizer.chat_template")? else { return Ok(None) };
        let bos = token_text(md, "tokenizer.ggml.bos_token_id")?.unwrap_or_default();
        let eos = token_text(md, "tokenizer.ggml.eos_token_id")?.unwrap_or_default();
        ChatTemplate::new(source, &bos, &eos).map(Some)
    }

    /// Compiles a template; `bos_token`/`eos_token` are the texts the template sees under those names.
    ///
    /// # Errors
    /// [`TemplateError::Compile`] with the parser's message.
    pub fn new(source: &str, bos_token: &str, eos_token: &str) -> Result<ChatTemplate, TemplateError> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.add_filter("tojson", tojson);
        env.add_template_owned(TEMPLATE_NAME, source.to_string()).map_err(TemplateError::Compile)?;
        let reads_tools = env
            .get_template(TEMPLATE_NAME)
            .map_err(TemplateError::Compile)?
            .undeclared_variables(false)
            .contains("tools");
        Ok(ChatTemplate { env, bos_token: bos_token.to_string(), eos_token: eos_token.to_string(), reads_tools })
    }

    /// Whether the template reads `tools`. Many small models' templates (SmolLM2's, for one) do
    /// not, and would drop tool definitions silently; callers then describe the tools themselves.
    pub fn reads_tools(&self) -> bool {
        self.reads_tools
    }

    /// Renders typed messages.
    ///
    /// # Errors
    /// [`TemplateError::Render`], including the template's own `raise_exception(..)`.
    pub fn render(&self, messages: &[ChatMessage], opts: &ChatOptions) -> Result<String, TemplateError> {
        let json: Vec<serde_json::Value> =
            messages.iter().map(|m| serde_json::to_value(m).unwrap_or(serde_json::Value::Null)).collect();
        self.render_values(Value::from_serialize(alias_reasoning(&json)), opts)
    }

    /// Renders messages given as JSON objects (each needs a string `role`).
    ///
    /// # Errors
    /// [`TemplateError::BadMessage`] for a message without a role, else as [`ChatTemplate::render`].
    pub fn render_json(&self, messages: &[serde_json::Value], opts: &ChatOptions) -> Result<String, TemplateError> {
        for (index, m) in messages.iter().enumerate() {
            if !m.get("role").is_some_and(|r| r.is_string()) {
                return Err(TemplateError::BadMessage { index });
            }
        }
        self.render_values(Value::from_serialize(alias_reasoning(messages)), opts)
    }

    fn render_values(&self, messages: Value, opts: &ChatOptions) -> Result<String, TemplateError> {
        let mut ctx: BTreeMap<String, Value> = BTreeMap::new();
        ctx.insert("bos_token".into(), Value::from(self.bos_token.as_str()));
        ctx.insert("eos_token".into(), Value::from(self.eos_token.as_str()));
        for (k, v) in &opts.extra {
            ctx.insert(k.clone(), Value::from_serialize(v));
        }
        if let Some(thinking) = opts.enable_thinking {
            ctx.insert("enable_thinking".into(), Value::from(thinking));
        }
        ctx.insert("messages".into(), messages);
        ctx.insert("tools".into(), opts.tools.as_ref().map_or(Value::from(()), Value::from_serialize));
        ctx.insert("documents".into(), Value::from(()));
        ctx.insert("add_generation_prompt".into(), Value::from(opts.add_generation_prompt));
        let template = self.env.get_template(TEMPLATE_NAME).map_err(TemplateError::Render)?;
        template.render(ctx).map_err(TemplateError::Render)
    }
}

/// The names transformers accepts for a message's reasoning, first one set wins.
const REASONING_FIELDS: [&str; 3] = ["reasoning_content", "thinking", "reasoning"];

/// transformers (`_alias_reasoning_fields`) gives a message with reasoning both `thinking` (first)
/// and `reasoning_content`, so templates of either family find it.
fn alias_reasoning(messages: &[serde_json::Value]) -> Vec<serde_json::Value> {
    messages
        .iter()
        .map(|message| {
            let Some(map) = message.as_object() else { return message.clone() };
            let reasoning = REASONING_FIELDS.iter().find_map(|k| map.get(*k).filter(|v| !v.is_null()));
            let Some(reasoning) = reasoning else { return message.clone() };
            let mut aliased = serde_json::Map::new();
            aliased.insert("thinking".to_string(), reasoning.clone());
            for (k, v) in map {
                aliased.insert(k.clone(), v.clone());
            }
            aliased.insert("reasoning_content".to_string(), reasoning.clone());
            serde_json::Value::Object(aliased)
        })
        .collect()
}

/// `raise_exception(message)`: fails the rendering with the template's message.
fn raise_exception(message: String) -> Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, message))
}

/// `strftime_now(format)`: the current UTC time formatted like Python's `strftime`.
fn strftime_now(format: String) -> String {
    let secs =
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs() as i64).unwrap_or(0);
    strftime(&format, secs)
}

const MONTHS: [&str; 12] = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
];
const WEEKDAYS: [&str; 7] = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"];

/// Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
fn civil_from_days(days: i64) -> (i64, u32, u32) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let month = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let year = yoe + era * 400 + i64::from(month <= 2);
    (year, month, day)
}

/// A subset of C `strftime` (the specifiers chat templates use), including glibc's `%-d` form.
fn strftime(format: &str, unix_secs: i64) -> String {
    let days = unix_secs.div_euclid(86_400);
    let secs_of_day = unix_secs.rem_euclid(86_400);
    let (year, month, day) = civil_from_days(days);
    let (hour, minute, second) = (secs_of_day / 3600, (secs_of_day / 60) % 60, secs_of_day % 60);
    let weekday = (days + 3).rem_euclid(7) as usize; // 1970-01-01 was a Thursday
    let is_leap = (year % 4 == 0 && year % 100 != 0) || year % 400 == 0;
    let cumulative = [0, 31, 59, 90, 120, 151, 181, 212, 243, 273, 304, 334];
    let day_of_year = cumulative[(month - 1) as usize] + day + u32::from(is_leap && month > 2);
    let mut out = String::new();
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        let mut spec = chars.next();
        let no_pad = spec == Some('-');
        if no_pad {
            spec = chars.next();
        }
        let num = |v: i64, width: usize| if no_pad { v.to_string() } else { format!("{v:0width$}") };
        match spec {
            Some('Y') => out.push_str(&year.to_string()),
            Some('y') => out.push_str(&num(year.rem_euclid(100), 2)),
            Some('m') => out.push_str(&num(month.into(), 2)),
            Some('d') => out.push_str(&num(day.into(), 2)),
            Some('e') => out.push_str(&format!("{day:2}")),
            Some('H') => out.push_str(&num(hour, 2)),
            Some('I') => out.push_str(&num(if hour % 12 == 0 { 12 } else { hour % 12 }, 2)),
            Some('M') => out.push_str(&num(minute, 2)),
            Some('S') => out.push_str(&num(second, 2)),
            Some('p') => out.push_str(if hour < 12 { "AM" } else { "PM" }),
            Some('j') => out.push_str(&num(day_of_year.into(), 3)),
            Some('B') => out.push_str(MONTHS[(month - 1) as usize]),
            Some('b') | Some('h') => out.push_str(&MONTHS[(month - 1) as usize][..3]),
            Some('A') => out.push_str(WEEKDAYS[weekday]),
            Some('a') => out.push_str(&WEEKDAYS[weekday][..3]),
            Some('%') => out.push('%'),
            Some(other) => {
                out.push('%');
                out.push(other);
            }
            None => out.push('%'),
        }
    }
    out
}

/// transformers' `tojson`: `json.dumps(x, ensure_ascii=False, indent=None, separators=None,
/// sort_keys=False)`.
fn tojson(value: &Value, kwargs: Kwargs) -> Result<Value, Error> {
    let ensure_ascii: Option<bool> = kwargs.get("ensure_ascii")?;
    let indent: Option<Value> = kwargs.get("indent")?;
    let separators: Option<Value> = kwargs.get("separators")?;
    let sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    kwargs.assert_all_used()?;
    let indent = match indent {
        None => None,
        Some(v) if v.is_none() => None,
        Some(v) if v.kind() == ValueKind::Number => {
            let n = v.as_i64().unwrap_or(0).max(0) as usize;
            Some(" ".repeat(n))
        }
        Some(v) => Some(v.as_str().unwrap_or("").to_string()),
    };
    let (item_sep, key_sep) = match separators.filter(|s| !s.is_none()) {
        Some(s) => {
            let a = s.get_item(&Value::from(0))?;
            let b = s.get_item(&Value::from(1))?;
            (a.as_str().unwrap_or(",").to_string(), b.as_str().unwrap_or(":").to_string())
        }
        None if indent.is_some() => (",".to_string(), ": ".to_string()),
        None => (", ".to_string(), ": ".to_string()),
    };
    let style = JsonStyle {
        ensure_ascii: ensure_ascii.unwrap_or(false),
        indent,
        item_sep,
        key_sep,
        sort_keys: sort_keys.unwrap_or(false),
    };
    let mut out = String::new();
    write_json(&mut out, value, &style, 0)?;
    Ok(Value::from_safe_string(out))
}

struct JsonStyle {
    ensure_ascii: bool,
    indent: Option<String>,
    item_sep: String,
    key_sep: String,
    sort_keys: bool,
}

fn write_json_string(out: &mut String, s: &str, ensure_ascii: bool) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c if ensure_ascii && (c as u32) > 0x7E => {
                let mut buf = [0u16; 2];
                for unit in c.encode_utf16(&mut buf) {
                    let _ = write!(out, "\\u{unit:04x}");
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

/// Python's `repr(float)`: shortest round-trip digits, scientific below 1e-4 and from 1e16.
fn python_float(f: f64) -> String {
    if f.is_nan() {
        return "NaN".to_string();
    }
    if f.is_infinite() {
        return if f > 0.0 { "Infinity" } else { "-Infinity" }.to_string();
    }
    if f == 0.0 {
        return if f.is_sign_negative() { "-0.0" } else { "0.0" }.to_string();
    }
    // `{:e}` gives the shortest round-trip digits: "-1.2345e-7".
    let sci = format!("{f:e}");
    let (mantissa, exp) = sci.split_once('e').unwrap_or((&sci, "0"));
    let exp: i32 = exp.parse().unwrap_or(0);
    let negative = mantissa.starts_with('-');
    let digits: String = mantissa.chars().filter(|c| c.is_ascii_digit()).collect();
    let sign = if negative { "-" } else { "" };
    if (-4..16).contains(&exp) {
        let point = exp + 1; // digits before the decimal point
        let body = if point <= 0 {
            format!("0.{}{}", "0".repeat((-point) as usize), digits)
        } else if point as usize >= digits.len() {
            format!("{}{}.0", digits, "0".repeat(point as usize - digits.len()))
        } else {
            format!("{}.{}", &digits[..point as usize], &digits[point as usize..])
        };
        format!("{sign}{body}")
    } else {
        let frac = if digits.len() > 1 { format!(".{}", &digits[1..]) } else { String::new() };
        let exp_sign = if exp < 0 { '-' } else { '+' };
        format!("{sign}{}{frac}e{exp_sign}{:02}", &digits[..1], exp.abs())
    }
}

fn write_json(out: &mut String, value: &Value, style: &JsonStyle, depth: usize) -> Result<(), Error> {
    let newline = |out: &mut String, depth: usize| {
        if let Some(ind) = &style.indent {
            out.push('\n');
            for _ in 0..depth {
                out.push_str(ind);
            }
        }
    };
    match value.kind() {
        ValueKind::Undefined | ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if value.is_true() { "true" } else { "false" }),
        ValueKind::Number => {
            if value.is_integer() {
                out.push_str(&value.to_string());
            } else {
                let f = f64::try_from(value.clone())?;
                out.push_str(&python_float(f));
            }
        }
        ValueKind::String => write_json_string(out, value.as_str().unwrap_or(""), style.ensure_ascii),
        ValueKind::Map => {
            let mut keys: Vec<Value> = value.try_iter()?.collect();
            if keys.is_empty() {
                out.push_str("{}");
                return Ok(());
            }
            if style.sort_keys {
                keys.sort_by_key(|k| k.to_string());
            }
            out.push('{');
            for (i, key) in keys.iter().enumerate() {
                if i > 0 {
                    out.push_str(&style.item_sep);
                }
                newline(out, depth + 1);
                let key_text = key.as_str().map(str::to_string).unwrap_or_else(|| key.to_string());
                write_json_string(out, &key_text, style.ensure_ascii);
                out.push_str(&style.key_sep);
                write_json(out, &value.get_item(key)?, style, depth + 1)?;
            }
            newline(out, depth);
            out.push('}');
        }
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<Value> = value.try_iter()?.collect();
            if items.is_empty() {
                out.push_str("[]");
                return Ok(());
            }
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(&style.item_sep);
                }
                newline(out, depth + 1);
                write_json(out, item, style, depth + 1)?;
            }
            newline(out, depth);
            out.push(']');
        }
        _ => write_json_string(out, &value.to_string(), style.ensure_ascii),
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn python_float_repr() {
        // Values of Python's repr().
        assert_eq!(python_float(1.0), "1.0");
        assert_eq!(python_float(0.1), "0.1");
        assert_eq!(python_float(1e-5), "1e-05");
        assert_eq!(python_float(1.5e16), "1.5e+16");
        assert_eq!(python_float(123456.789), "123456.789");
        assert_eq!(python_float(-0.00012), "-0.00012");
        assert_eq!(python_float(1e22), "1e+22");
    }

    #[test]
    fn strftime_known_dates() {
        // 2024-02-29 13:05:09 UTC was a Thursday, day 60 of the year.
        let t = 1_709_211_909;
        assert_eq!(strftime("%Y-%m-%d %H:%M:%S", t), "2024-02-29 13:05:09");
        assert_eq!(strftime("%d %b %Y", t), "29 Feb 2024");
        assert_eq!(strftime("%A %B %-d %j %I%p", t), "Thursday February 29 060 01PM");
        assert_eq!(strftime("%d %B %Y", 0), "01 January 1970");
    }

    #[test]
    fn knows_whether_a_template_reads_tools() {
        let plain = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}";
        let with_tools =
            "{% if tools %}{{ tools | tojson }}{% endif %}{% for m in messages %}{{ m.content }}{% endfor %}";
        assert!(!ChatTemplate::new(plain, "", "").unwrap().reads_tools());
        assert!(ChatTemplate::new(with_tools, "", "").unwrap().reads_tools());
    }
}
