//! Chat templates: Hugging Face Jinja templates rendered with minijinja.
//!
//! The environment mirrors what transformers gives a template: `trim_blocks` and `lstrip_blocks`
//! on, Python string methods (`.strip()`, `.startswith()`, ...) through minijinja-contrib's
//! pycompat, `raise_exception(msg)`, and the variables `messages`, `add_generation_prompt`,
//! `bos_token`, `eos_token`. A template that raises becomes an error carrying its message.

// Data here comes from files, HTTP bodies and the command line: no unwrap, expect or indexing
// that could panic on it (issue 21; clippy enforces it in CI).
#![warn(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing,
    clippy::panic
)]

use std::path::Path;

use anyhow::{anyhow, bail, Context, Result};
use minijinja::{context, Environment, Error, ErrorKind};
use serde::{Deserialize, Serialize};

const TEMPLATE_NAME: &str = "chat_template";

/// One turn of a conversation.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Message {
    pub role: String,
    pub content: String,
}

impl Message {
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        Self {
            role: role.into(),
            content: content.into(),
        }
    }
}

/// A compiled chat template with the model's BOS/EOS token texts.
pub struct ChatTemplate {
    env: Environment<'static>,
    bos_token: Option<String>,
    eos_token: Option<String>,
}

impl ChatTemplate {
    /// Compiles `source`; syntax errors are reported here, not at the first render.
    pub fn new(source: &str, bos_token: Option<String>, eos_token: Option<String>) -> Result<Self> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", |msg: String| -> Result<String, Error> {
            Err(Error::new(ErrorKind::InvalidOperation, msg))
        });
        env.add_template_owned(TEMPLATE_NAME, source.to_string())
            .map_err(|e| anyhow!("the chat template does not compile: {e:#}"))?;
        Ok(Self {
            env,
            bos_token,
            eos_token,
        })
    }

    /// Renders the conversation; with `add_generation_prompt` the text ends where the assistant's
    /// reply begins.
    pub fn render(&self, messages: &[Message], add_generation_prompt: bool) -> Result<String> {
        let tmpl = self
            .env
            .get_template(TEMPLATE_NAME)
            .map_err(|e| anyhow!("chat template: {e:#}"))?;
        tmpl.render(context! {
            messages => messages,
            add_generation_prompt => add_generation_prompt,
            bos_token => self.bos_token.as_deref().unwrap_or(""),
            eos_token => self.eos_token.as_deref().unwrap_or(""),
        })
        .map_err(|e| anyhow!("rendering the chat template: {e:#}"))
    }
}

/// Reads a `--messages FILE`: a JSON array of `{"role", "content"}` objects.
pub fn read_messages(path: &Path) -> Result<Vec<Message>> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("--messages: cannot read {}", path.display()))?;
    let messages: Vec<Message> = serde_json::from_str(&text).map_err(|e| {
        anyhow!(
            "--messages {}: expected a JSON array of {{\"role\": ..., \"content\": ...}} objects: {e}",
            path.display()
        )
    })?;
    if messages.is_empty() {
        bail!("--messages {}: the array holds no messages", path.display());
    }
    if let Some(i) = messages.iter().position(|m| m.role.trim().is_empty()) {
        bail!(
            "--messages {}: message {i} has an empty role",
            path.display()
        );
    }
    Ok(messages)
}
