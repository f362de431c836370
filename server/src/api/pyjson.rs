//! JSON written the way Python's `json.dumps(obj, ensure_ascii=False)` writes it (", " and ": "
//! separators), as llm-serving's stream lines are; plus escaping of the characters Python's
//! `str.splitlines` treats as line breaks, so `iter_lines` clients never see a line split
//! inside a JSON value.

use serde::Serialize;
use serde_json::ser::Formatter;
use std::io;

struct PythonFormatter;

impl Formatter for PythonFormatter {
    fn begin_array_value<W: ?Sized + io::Write>(
        &mut self,
        w: &mut W,
        first: bool,
    ) -> io::Result<()> {
        if first {
            Ok(())
        } else {
            w.write_all(b", ")
        }
    }

    fn begin_object_key<W: ?Sized + io::Write>(
        &mut self,
        w: &mut W,
        first: bool,
    ) -> io::Result<()> {
        if first {
            Ok(())
        } else {
            w.write_all(b", ")
        }
    }

    fn begin_object_value<W: ?Sized + io::Write>(&mut self, w: &mut W) -> io::Result<()> {
        w.write_all(b": ")
    }
}

/// Serializes `value` in Python's `json.dumps` style.
pub(crate) fn to_python_json<T: Serialize>(value: &T) -> String {
    let mut out = Vec::with_capacity(256);
    let mut ser = serde_json::Serializer::with_formatter(&mut out, PythonFormatter);
    if value.serialize(&mut ser).is_err() {
        return "null".into();
    }
    let s = String::from_utf8(out).unwrap_or_default();
    escape_line_breaks(s)
}

/// Replaces U+0085, U+2028 and U+2029 (only possible inside JSON strings) with \u escapes.
pub(crate) fn escape_line_breaks(s: String) -> String {
    if !s.contains(['\u{85}', '\u{2028}', '\u{2029}']) {
        return s;
    }
    let mut out = String::with_capacity(s.len() + 12);
    for c in s.chars() {
        match c {
            '\u{85}' => out.push_str("\\u0085"),
            '\u{2028}' => out.push_str("\\u2028"),
            '\u{2029}' => out.push_str("\\u2029"),
            c => out.push(c),
        }
    }
    out
}

/// An f32 as the shortest decimal that reads back to it (not its f64 widening noise);
/// non-finite values (a -inf log-probability) become -9999.0 as OpenAI reports them.
pub(crate) fn f32_json(x: f32) -> f64 {
    if !x.is_finite() {
        return -9999.0;
    }
    format!("{x}").parse::<f64>().unwrap_or(x as f64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn python_separators_and_unescaped_unicode() {
        let v = serde_json::json!({"a": [1, 2], "b": "héllo\n"});
        assert_eq!(to_python_json(&v), "{\"a\": [1, 2], \"b\": \"héllo\\n\"}");
    }

    #[test]
    fn python_line_breaks_are_escaped() {
        let s = to_python_json(&serde_json::json!(["x\u{2028}y\u{85}\u{1c}"]));
        assert_eq!(s, "[\"x\\u2028y\\u0085\\u001c\"]");
        assert_eq!(s.lines().count(), 1);
        let back: Vec<String> = serde_json::from_str(&s).unwrap();
        assert_eq!(back[0], "x\u{2028}y\u{85}\u{1c}");
    }

    #[test]
    fn f32_values_print_short() {
        assert_eq!(f32_json(-0.1).to_string(), "-0.1");
        assert_eq!(f32_json(f32::NEG_INFINITY), -9999.0);
    }
}
