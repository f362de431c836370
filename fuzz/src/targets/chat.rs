//! Chat templates: a template is code from a downloaded file, rendered with messages from a
//! client. Input: the template source, a NUL, then messages as NUL-separated role / content pairs;
//! the first byte of the messages part sets `add_generation_prompt` (bit 0) and whether the
//! render carries extra variables (bit 1, as a request's `chat_template_kwargs`). Compiling and
//! rendering must end with text or an error, in bounded time and output.

use npu_tokenizer::{ChatMessage, ChatTemplate};

/// The most rendered text a template may produce (the render's own limit is tested here).
const MAX_RENDERED: usize = npu_tokenizer::MAX_RENDERED_BYTES;

pub fn run(data: &[u8]) {
    let (source, rest) = crate::split_once(data, 0);
    let Ok(template) = ChatTemplate::new(String::from_utf8_lossy(source), "<s>", "</s>") else {
        return;
    };
    let (flags, rest) = rest.split_first().map_or((0, rest), |(f, r)| (*f, r));
    let mut parts = rest.split(|&b| b == 0);
    let mut messages = Vec::new();
    while let (Some(role), Some(content)) = (parts.next(), parts.next()) {
        messages.push(ChatMessage::new(
            String::from_utf8_lossy(role),
            String::from_utf8_lossy(content),
        ));
    }
    let add_generation_prompt = flags & 1 != 0;
    let rendered = if flags & 2 != 0 {
        let mut extra = serde_json::Map::new();
        extra.insert("enable_thinking".into(), false.into());
        extra.insert(
            "tools".into(),
            serde_json::json!([{"type": "function", "function": {"name": "f", "parameters": {}}}]),
        );
        template.render_with(&messages, add_generation_prompt, &extra)
    } else {
        template.render(&messages, add_generation_prompt)
    };
    if let Ok(text) = rendered {
        assert!(text.len() <= MAX_RENDERED, "rendered {} bytes", text.len());
    }
}
