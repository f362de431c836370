//! Chat templates: the model's Jinja template from GGUF `tokenizer.chat_template`, rendered with
//! minijinja the way Hugging Face renders it (trim/lstrip blocks, `raise_exception`,
//! `strftime_now`, Python string methods, `bos_token`/`eos_token`), and a ChatML fallback.

use minijinja::{Environment, Error as JinjaError, ErrorKind};
use serde::{Deserialize, Serialize};

use super::TokenizerError;

use std::sync::atomic::{AtomicBool, AtomicU8, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc};
use std::time::Duration;

/// Longest a render may take. Fuel bounds the template's instructions, but a single instruction
/// can iterate without end (`0 in [1] * 10**15`): the render runs on a thread of its own, and
/// past this limit the request gets an error and the template is not rendered again.
pub const RENDER_TIME_LIMIT: Duration = Duration::from_secs(2);

/// Most instructions one render may run. A template is code from a downloaded file: without a
/// bound, nested loops run for hours. Real templates take a few hundred instructions a message
/// (Qwen3's with tools about 300), so this allows conversations of over ten thousand messages.
pub const RENDER_FUEL: u64 = 5_000_000;

/// Most bytes one render may write: far past any context window's worth of text, short of
/// what would exhaust memory.
pub const MAX_RENDERED_BYTES: usize = 64 << 20;

/// The render's output, refusing to grow past [`MAX_RENDERED_BYTES`].
struct BoundedOutput {
    text: Vec<u8>,
    overflowed: bool,
}

impl std::io::Write for BoundedOutput {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        if self.text.len() + buf.len() > MAX_RENDERED_BYTES {
            self.overflowed = true;
            return Err(std::io::Error::other("output limit"));
        }
        self.text.extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Template threads that ran past [`RENDER_TIME_LIMIT`] and have not ended yet.
static OVERRUN_THREADS: AtomicUsize = AtomicUsize::new(0);

/// How many template threads are still running past [`RENDER_TIME_LIMIT`]: each holds a core
/// until its template ends (if it ever does). A process that runs untrusted templates in a loop
/// (the fuzzer's driver) restarts when this is not zero.
pub fn overrun_template_threads() -> usize {
    OVERRUN_THREADS.load(Ordering::Relaxed)
}

/// Runs `work` on a thread of its own and waits at most [`RENDER_TIME_LIMIT`] for it. Past the
/// limit the thread is left to spin (nothing can stop it), counted in [`overrun_template_threads`]
/// until it ends, and the caller gets an error.
fn within_time_limit<T: Send + 'static>(
    what: &str,
    work: impl FnOnce() -> T + Send + 'static,
) -> Result<T, TokenizerError> {
    within_limit_counted(what, RENDER_TIME_LIMIT, &OVERRUN_THREADS, work)
}

/// [`within_time_limit`] with the limit and the count of overrunning threads as arguments.
fn within_limit_counted<T: Send + 'static>(
    what: &str,
    limit: Duration,
    overruns: &'static AtomicUsize,
    work: impl FnOnce() -> T + Send + 'static,
) -> Result<T, TokenizerError> {
    const RUNNING: u8 = 0;
    const DONE: u8 = 1;
    const ABANDONED: u8 = 2;
    let (tx, rx) = mpsc::channel();
    let state = Arc::new(AtomicU8::new(RUNNING));
    let thread_state = Arc::clone(&state);
    std::thread::Builder::new()
        .name("chat-template".into())
        .spawn(move || {
            let _ = tx.send(work());
            if thread_state
                .compare_exchange(RUNNING, DONE, Ordering::AcqRel, Ordering::Acquire)
                .is_err()
            {
                // The waiter gave up on this thread and counted it: it has ended now.
                overruns.fetch_sub(1, Ordering::AcqRel);
            }
        })
        .map_err(|e| TokenizerError::Template(format!("cannot start a {what}: {e}")))?;
    match rx.recv_timeout(limit) {
        Ok(done) => Ok(done),
        Err(mpsc::RecvTimeoutError::Timeout) => {
            // Counted before it is marked abandoned, so the thread's uncount never comes first.
            overruns.fetch_add(1, Ordering::AcqRel);
            if state
                .compare_exchange(RUNNING, ABANDONED, Ordering::AcqRel, Ordering::Acquire)
                .is_err()
            {
                // It finished between the timeout and here: nothing is left running.
                overruns.fetch_sub(1, Ordering::AcqRel);
                if let Ok(done) = rx.recv() {
                    return Ok(done);
                }
            }
            Err(TokenizerError::Template(format!(
                "cannot {what}: the template ran past the limit of {limit:?} (an \
                 endless loop?); it is not rendered again"
            )))
        }
        Err(mpsc::RecvTimeoutError::Disconnected) => Err(TokenizerError::Template(format!(
            "cannot {what}: the template engine panicked"
        ))),
    }
}

/// Renders `ctx` under the fuel and output bounds.
fn bounded_render(
    template: &minijinja::Template<'_, '_>,
    ctx: minijinja::Value,
) -> Result<String, TokenizerError> {
    let mut out = BoundedOutput {
        text: Vec::new(),
        overflowed: false,
    };
    let rendered = template.render_captured_to(ctx, &mut out);
    if out.overflowed {
        return Err(TokenizerError::Template(format!(
            "cannot render: the rendered text is over the limit of {MAX_RENDERED_BYTES} bytes"
        )));
    }
    rendered.map_err(|e| template_error("cannot render", e))?;
    String::from_utf8(out.text)
        .map_err(|_| TokenizerError::Template("the rendered text is not UTF-8".into()))
}

/// One message of a conversation.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
    /// An assistant turn's tool calls (OpenAI's list, arguments as JSON objects where they
    /// parse), for templates that render them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<serde_json::Value>,
    /// A tool turn: the call it answers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
    /// A tool turn: the function's name, when given.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
}

impl ChatMessage {
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        Self {
            role: role.into(),
            content: content.into(),
            tool_calls: None,
            tool_call_id: None,
            name: None,
        }
    }

    pub fn system(content: impl Into<String>) -> Self {
        Self::new("system", content)
    }

    pub fn user(content: impl Into<String>) -> Self {
        Self::new("user", content)
    }

    pub fn assistant(content: impl Into<String>) -> Self {
        Self::new("assistant", content)
    }
}

/// ChatML, used when the model carries no template.
const CHATML: &str = "{% for message in messages %}\
{{ '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}\
{% endfor %}\
{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}";

/// Gemma's turn format (`<start_of_turn>user\n...<end_of_turn>\n`, the assistant named
/// `model`, a system message joined to the first user turn), used for a model without a
/// template whose vocabulary has Gemma's turn tokens.
const GEMMA: &str = "{{ bos_token }}\
{% if messages and messages[0].role == 'system' %}\
{% set first_user_prefix = messages[0].content ~ '\n\n' %}{% set loop_messages = messages[1:] %}\
{% else %}{% set first_user_prefix = '' %}{% set loop_messages = messages %}{% endif %}\
{% for message in loop_messages %}\
{% set role = 'model' if message.role == 'assistant' else message.role %}\
{{ '<start_of_turn>' ~ role ~ '\n' ~ (first_user_prefix if loop.first else '') ~ (message.content | trim) ~ '<end_of_turn>\n' }}\
{% endfor %}\
{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}";

const TEMPLATE_NAME: &str = "chat_template";

/// A compiled chat template.
#[derive(Clone)]
pub struct ChatTemplate {
    env: Arc<Environment<'static>>,
    /// Set once a render of this template ran past [`RENDER_TIME_LIMIT`]: its thread may still
    /// be spinning, and the template is not rendered again.
    stalled: Arc<AtomicBool>,
    bos_token: String,
    eos_token: String,
    is_fallback: bool,
    /// The template's text (what it knows of `tools`, `tool_calls` and thinking is read from it).
    source: Arc<str>,
}

fn template_error(what: &str, e: JinjaError) -> TokenizerError {
    let mut msg = format!("{what}: {e}");
    if let Some(line) = e.line() {
        msg.push_str(&format!(" (template line {line})"));
    }
    TokenizerError::Template(msg)
}

impl ChatTemplate {
    /// Compiles `source`; syntax errors are reported here rather than at render time.
    pub fn new(
        source: impl Into<String>,
        bos_token: impl Into<String>,
        eos_token: impl Into<String>,
    ) -> Result<Self, TokenizerError> {
        Self::compile(source.into(), bos_token.into(), eos_token.into(), false)
    }

    /// The ChatML template (`<|im_start|>role\ncontent<|im_end|>\n`).
    pub fn chatml(bos_token: impl Into<String>, eos_token: impl Into<String>) -> Self {
        Self::compile(CHATML.to_string(), bos_token.into(), eos_token.into(), true)
            .expect("the built-in ChatML template compiles")
    }

    /// Gemma's turn format (see `GEMMA`), for a Gemma model whose file has no template.
    pub fn gemma(bos_token: impl Into<String>, eos_token: impl Into<String>) -> Self {
        Self::compile(GEMMA.to_string(), bos_token.into(), eos_token.into(), true)
            .expect("the built-in Gemma template compiles")
    }

    fn compile(
        source: String,
        bos_token: String,
        eos_token: String,
        is_fallback: bool,
    ) -> Result<Self, TokenizerError> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_fuel(Some(RENDER_FUEL));
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function(
            "raise_exception",
            |msg: String| -> Result<String, JinjaError> {
                Err(JinjaError::new(ErrorKind::InvalidOperation, msg))
            },
        );
        env.add_function("strftime_now", |format: String| {
            strftime_utc(&format, unix_now())
        });
        let text: Arc<str> = Arc::from(source.as_str());
        // Compiling folds constant expressions, which can iterate without end as a render can.
        let env = within_time_limit("compile", move || {
            env.add_template_owned(TEMPLATE_NAME, source)
                .map_err(|e| template_error("cannot compile", e))?;
            Ok(env)
        })??;
        Ok(Self {
            env: Arc::new(env),
            stalled: Arc::new(AtomicBool::new(false)),
            bos_token,
            eos_token,
            is_fallback,
            source: text,
        })
    }

    /// The template's text.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// Renders a conversation; with `add_generation_prompt` the text ends where the assistant's
    /// reply begins. Errors raised by the template (`raise_exception`) come back as `Template`.
    pub fn render(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<String, TokenizerError> {
        self.render_value(minijinja::context! {
            messages => messages,
            add_generation_prompt => add_generation_prompt,
            bos_token => &self.bos_token,
            eos_token => &self.eos_token,
        })
    }

    /// `render` with extra template variables, such as a chat request's `chat_template_kwargs`
    /// (`{"enable_thinking": false}` for Qwen3): each key of `extra` is a variable of the
    /// template; `messages`, `add_generation_prompt`, `bos_token` and `eos_token` keep the
    /// values `render` gives them.
    pub fn render_with(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
        extra: &serde_json::Map<String, serde_json::Value>,
    ) -> Result<String, TokenizerError> {
        const STANDARD: [&str; 4] = [
            "messages",
            "add_generation_prompt",
            "bos_token",
            "eos_token",
        ];
        let extra: serde_json::Map<String, serde_json::Value> = extra
            .iter()
            .filter(|(k, _)| !STANDARD.contains(&k.as_str()))
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        let standard = minijinja::context! {
            messages => messages,
            add_generation_prompt => add_generation_prompt,
            bos_token => &self.bos_token,
            eos_token => &self.eos_token,
        };
        let vars =
            minijinja::value::merge_maps([standard, minijinja::Value::from_serialize(&extra)]);
        self.render_value(vars)
    }

    /// Renders on a thread of its own under [`RENDER_TIME_LIMIT`] (and the fuel and output
    /// bounds of `bounded_render`).
    fn render_value(&self, ctx: minijinja::Value) -> Result<String, TokenizerError> {
        if self.stalled.load(Ordering::Relaxed) {
            return Err(TokenizerError::Template(format!(
                "cannot render: this template once ran past the limit of {RENDER_TIME_LIMIT:?} \
                 and is not rendered again"
            )));
        }
        let env = Arc::clone(&self.env);
        let rendered = within_time_limit("render", move || {
            env.get_template(TEMPLATE_NAME)
                .map_err(|e| template_error("missing", e))
                .and_then(|t| bounded_render(&t, ctx))
        });
        match rendered {
            Ok(rendered) => rendered,
            Err(e) => {
                self.stalled.store(true, Ordering::Relaxed);
                Err(e)
            }
        }
    }

    /// Whether this is the ChatML fallback rather than the model's own template.
    pub fn is_fallback(&self) -> bool {
        self.is_fallback
    }
}

fn unix_now() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs() as i64)
}

/// Formats a UTC time with the common `strftime` fields (`%Y %y %m %d %e %B %b %A %a %H %M %S
/// %j %%`); other fields are kept as written. Templates use it for "today's date".
fn strftime_utc(format: &str, unix_secs: i64) -> String {
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
    const DAYS: [&str; 7] = [
        "Sunday",
        "Monday",
        "Tuesday",
        "Wednesday",
        "Thursday",
        "Friday",
        "Saturday",
    ];
    let days = unix_secs.div_euclid(86_400);
    let secs = unix_secs.rem_euclid(86_400);
    // Civil date from days since 1970-01-01 (proleptic Gregorian, eras of 400 years).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    let leap = (year % 4 == 0 && year % 100 != 0) || year % 400 == 0;
    let before_month = [0, 31, 59, 90, 120, 151, 181, 212, 243, 273, 304, 334][month as usize - 1];
    let day_of_year = before_month + day + i64::from(leap && month > 2);
    let weekday = (days + 4).rem_euclid(7) as usize; // 1970-01-01 was a Thursday

    let mut out = String::with_capacity(format.len() + 16);
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('Y') => out.push_str(&year.to_string()),
            Some('y') => out.push_str(&format!("{:02}", year.rem_euclid(100))),
            Some('m') => out.push_str(&format!("{month:02}")),
            Some('d') => out.push_str(&format!("{day:02}")),
            Some('e') => out.push_str(&format!("{day:2}")),
            Some('B') => out.push_str(MONTHS[month as usize - 1]),
            Some('b') => out.push_str(&MONTHS[month as usize - 1][..3]),
            Some('A') => out.push_str(DAYS[weekday]),
            Some('a') => out.push_str(&DAYS[weekday][..3]),
            Some('H') => out.push_str(&format!("{:02}", secs / 3600)),
            Some('M') => out.push_str(&format!("{:02}", secs / 60 % 60)),
            Some('S') => out.push_str(&format!("{:02}", secs % 60)),
            Some('j') => out.push_str(&format!("{day_of_year:03}")),
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

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("is_fallback", &self.is_fallback)
            .field("bos_token", &self.bos_token)
            .field("eos_token", &self.eos_token)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gemma_fallback_renders_turns_with_the_system_message_in_the_first() {
        let t = ChatTemplate::gemma("<bos>", "<eos>");
        let text = t
            .render(
                &[
                    ChatMessage::system("Be brief."),
                    ChatMessage::user("Hi "),
                    ChatMessage::assistant("Hello."),
                    ChatMessage::user("Why?"),
                ],
                true,
            )
            .unwrap();
        assert_eq!(
            text,
            "<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n\
             <start_of_turn>model\nHello.<end_of_turn>\n\
             <start_of_turn>user\nWhy?<end_of_turn>\n<start_of_turn>model\n"
        );
        assert!(t.is_fallback());
    }

    #[test]
    fn chatml_fallback_renders_roles_and_generation_prompt() {
        let t = ChatTemplate::chatml("", "<|im_end|>");
        let out = t
            .render(
                &[ChatMessage::system("S"), ChatMessage::user("Hi\nthere")],
                true,
            )
            .unwrap();
        assert_eq!(
            out,
            "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nHi\nthere<|im_end|>\n<|im_start|>assistant\n"
        );
        assert!(t.is_fallback());
        let no_prompt = t.render(&[ChatMessage::user("x")], false).unwrap();
        assert_eq!(no_prompt, "<|im_start|>user\nx<|im_end|>\n");
    }

    #[test]
    fn raise_exception_becomes_a_template_error() {
        let t = ChatTemplate::new(
            "{% if messages[0].role != 'user' %}{{ raise_exception('first must be user') }}{% endif %}ok",
            "<s>",
            "</s>",
        )
        .unwrap();
        let err = t.render(&[ChatMessage::assistant("a")], false).unwrap_err();
        assert!(
            matches!(&err, TokenizerError::Template(m) if m.contains("first must be user")),
            "{err}"
        );
        assert_eq!(t.render(&[ChatMessage::user("a")], false).unwrap(), "ok");
    }

    #[test]
    fn strftime_fields() {
        // 2024-02-29T13:05:09Z, a Thursday, day 60 of a leap year.
        let t = 1_709_211_909;
        assert_eq!(
            strftime_utc("%Y-%m-%d %H:%M:%S %j %a %A %b %B %y %e %% %Q", t),
            "2024-02-29 13:05:09 060 Thu Thursday Feb February 24 29 % %Q"
        );
        assert_eq!(strftime_utc("%d %b %Y", 0), "01 Jan 1970");
        assert_eq!(strftime_utc("%Y-%m-%d %a", 951_782_400), "2000-02-29 Tue");
        assert_eq!(strftime_utc("%Y-%m-%d", -86_400), "1969-12-31");
        let t = ChatTemplate::new("{{ strftime_now('%Y') }}", "", "").unwrap();
        let year: i64 = t.render(&[], false).unwrap().parse().unwrap();
        assert!(year >= 2024, "{year}");
    }

    #[test]
    fn syntax_errors_are_reported_at_compile_time() {
        let err = ChatTemplate::new("{% for m in messages %}", "", "").unwrap_err();
        assert!(matches!(err, TokenizerError::Template(_)), "{err}");
    }

    #[test]
    fn python_string_methods_and_block_trimming_work() {
        let src = "{{ bos_token }}{% for m in messages %}\n  {{ m.content.strip().upper() }}|\n{% endfor %}";
        let t = ChatTemplate::new(src, "<s>", "</s>").unwrap();
        assert_eq!(
            t.render(&[ChatMessage::user("  a "), ChatMessage::user("b")], false)
                .unwrap(),
            "<s>  A|\n  B|\n"
        );
    }

    #[test]
    fn a_render_is_bounded_in_time_and_output() {
        let msgs = [ChatMessage::user("hi")];
        // 10^10 iterations: stopped by the fuel limit, not run for hours.
        let t = ChatTemplate::new(
            "{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}",
            "",
            "",
        )
        .unwrap();
        let e = t.render(&msgs, false).unwrap_err().to_string();
        assert!(e.contains("fuel"), "{e}");
        // 100 MB of output: stopped at the output limit.
        let t = ChatTemplate::new(
            "{% for a in range(100000) %}{{ 'x' * 1000 }}{% endfor %}",
            "",
            "",
        )
        .unwrap();
        let e = t.render(&msgs, false).unwrap_err().to_string();
        assert!(e.contains("bytes"), "{e}");
        // One instruction iterating without end: stopped by the time limit, and the template
        // is not rendered again (its thread may still spin).
        let t = ChatTemplate::new("{{ -1 in messages * 1000000000000000 }}", "", "").unwrap();
        let e = t.render(&msgs, false).unwrap_err().to_string();
        assert!(e.contains("ran past the limit"), "{e}");
        let started = std::time::Instant::now();
        let e = t.clone().render(&msgs, false).unwrap_err().to_string();
        assert!(e.contains("not rendered again"), "{e}");
        assert!(started.elapsed() < RENDER_TIME_LIMIT);
        // Compiling folds constants, so a constant endless expression stops there.
        let Err(e) = ChatTemplate::new("{{ 0 in [1] * 1000000000000000 }}", "", "") else {
            panic!("an endless constant expression compiled");
        };
        let e = e.to_string();
        assert!(e.contains("cannot compile") && e.contains("limit"), "{e}");
        // A long real conversation stays well inside both.
        let t = ChatTemplate::chatml("", "");
        let long: Vec<ChatMessage> = (0..5000)
            .map(|i| ChatMessage::user(format!("turn {i}")))
            .collect();
        assert!(t.render(&long, true).is_ok());
    }

    #[test]
    fn an_overrunning_thread_is_counted_until_it_ends() {
        static OVERRUNS: AtomicUsize = AtomicUsize::new(0);
        let limit = Duration::from_millis(100);
        let quick = within_limit_counted("render", limit, &OVERRUNS, || 7);
        assert_eq!(quick.unwrap(), 7);
        assert_eq!(OVERRUNS.load(Ordering::Acquire), 0);
        let slow = within_limit_counted("render", limit, &OVERRUNS, || {
            std::thread::sleep(Duration::from_millis(600));
        });
        let e = slow.unwrap_err().to_string();
        assert!(e.contains("ran past the limit of 100ms"), "{e}");
        assert_eq!(OVERRUNS.load(Ordering::Acquire), 1);
        let started = std::time::Instant::now();
        while OVERRUNS.load(Ordering::Acquire) != 0 {
            assert!(
                started.elapsed() < Duration::from_secs(10),
                "an ended thread is still counted"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}
