//! From `--model` (and friends) to a ready decoder, tokenizer and chat template.
//!
//! `--model` is resolved in this order: absent → the default model (fetched once into
//! KVQ_HOME); an existing `.gguf` file; an existing directory (config.json + safetensors +
//! tokenizer.json); anything else is taken as a Hugging Face repo id.

// Data here comes from files, HTTP bodies and the command line: no unwrap, expect or indexing
// that could panic on it (issue 21; clippy enforces it in CI).
#![warn(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing,
    clippy::panic
)]

use anyhow::{bail, Context, Result};
use candle_core::quantized::gguf_file;
use candle_core::{DType, Device};
use std::path::{Path, PathBuf};

use super::chat::ChatTemplate;
use super::config::ModelConfig;
use super::fetch;
use super::fingerprint::WeightSource;
use super::hub::{self, HubModel, ModelFiles};
use super::linear::WeightMath;
use super::llama::Llama;
use super::options::{LoadFormat, ModelOptions};
use super::tokenizer::TextTokenizer;
use super::weights::{GgufMath, Weights};
use crate::kv::cache::prompt_file::ModelIdentity;

pub struct LoadedModel {
    pub model: Llama,
    pub tokenizer: TextTokenizer,
    pub chat_template: Option<ChatTemplate>,
    /// What was loaded, for messages and prompt-cache fingerprints.
    pub description: String,
    /// Where the chat template comes from (the model, or `--tokenizer FILE`), for messages.
    pub template_owner: String,
    /// Where the weights came from (their fingerprint identifies them in prompt caches).
    pub source: WeightSource,
    /// How the matmuls are computed (dense weights, kvq's block kernels, candle's quantized
    /// matmul): each gives slightly different K/V.
    pub weight_math: WeightMath,
}

impl LoadedModel {
    /// Renders a conversation with the model's chat template (ending with the assistant's
    /// turn) and tokenizes it; the template supplies any BOS.
    pub fn encode_chat(&self, messages: &[super::chat::Message]) -> Result<Vec<u32>> {
        let template = self.chat_template.as_ref().with_context(|| {
            format!(
                "{} has no chat template: send the prompt as plain text with --raw",
                self.template_owner
            )
        })?;
        let text = template.render(messages, true)?;
        self.tokenizer.encode(&text, false)
    }

    /// What a prompt cache must have been made by to be used with this model.
    pub fn identity(&self) -> Result<ModelIdentity> {
        let c = self.model.config();
        Ok(ModelIdentity {
            fingerprint: self.source.fingerprint()?,
            weights: match self.weight_math {
                WeightMath::Dense => "dense",
                WeightMath::Blocks => "blocks",
                WeightMath::Quantized => "quantized",
            }
            .into(),
            num_layers: c.num_layers,
            num_kv_heads: c.num_kv_heads,
            head_dim: c.head_dim,
        })
    }
}

/// Loads what `args` names onto `device`.
pub fn load(args: &ModelOptions, device: &Device) -> Result<LoadedModel> {
    let dtype = args.dtype_for(device);
    if args.load_format == LoadFormat::Dummy {
        return load_dummy(args, device, dtype);
    }
    if args.config.is_some() {
        bail!("--config is only used with --load-format dummy");
    }
    let (model, tokenizer, description, source) = match &args.model {
        None => {
            let path = fetch::default_model()?;
            load_gguf(&path, args, device, dtype)?
        }
        Some(spec) => {
            let p = Path::new(spec);
            check_model_path(p, spec)?;
            if p.is_file() {
                load_gguf(p, args, device, dtype)?
            } else if p.is_dir() {
                let files = hub::model_files_in_dir(p)?;
                load_safetensors(&files, args, device, dtype, spec)?
            } else if looks_like_path(spec) {
                bail!("--model {spec}: no such file or directory");
            } else {
                match hub::resolve_repo(spec)? {
                    HubModel::Gguf(path) => load_gguf(&path, args, device, dtype)?,
                    HubModel::Safetensors { dir_files: files } => {
                        load_safetensors(&files, args, device, dtype, spec)?
                    }
                }
            }
        }
    };
    let tokenizer = match &args.tokenizer {
        Some(t) => {
            let custom = TextTokenizer::from_files(t, None, &[])?;
            check_same_vocabulary(&custom, &tokenizer, t, &description)?;
            custom.with_special_tokens_of(&tokenizer)
        }
        None => tokenizer,
    };
    let template_owner = match &args.tokenizer {
        Some(t) => format!("--tokenizer {}", t.display()),
        None => description.clone(),
    };
    let chat_template = match tokenizer.chat_template() {
        Some(src) => Some(
            ChatTemplate::new(
                src,
                tokenizer.bos_token().map(|(_, t)| t),
                tokenizer.eos_token(),
            )
            .context("the model's chat template does not compile")?,
        ),
        None => None,
    };
    let weight_math = model.weight_math();
    Ok(LoadedModel {
        model,
        tokenizer,
        chat_template,
        description,
        template_owner,
        source,
        weight_math,
    })
}

/// Refuses a `--tokenizer` whose vocabulary is not the model's own: the same size and, id by
/// id, the same token strings (the model's BOS and EOS included). Another vocabulary would make
/// the model read ids it was not trained on and emit ids the tokenizer decodes to other text.
fn check_same_vocabulary(
    custom: &TextTokenizer,
    own: &TextTokenizer,
    path: &Path,
    description: &str,
) -> Result<()> {
    let (have, want) = (custom.vocab_size(), own.vocab_size());
    if have != want {
        bail!(
            "--tokenizer {} has {have} tokens, but {description}'s own tokenizer has {want}: they \
             do not belong together (the model would emit ids it cannot decode)",
            path.display()
        );
    }
    let special = own
        .bos_token()
        .map(|(id, _)| id)
        .into_iter()
        .chain(own.eos_token_ids().iter().copied());
    let ids = special.chain(0..u32::try_from(want).unwrap_or(u32::MAX));
    for id in ids {
        let Some(mine) = own.id_to_token(id) else {
            continue; // a duplicate string in the model's list: only its first id is reachable
        };
        let theirs = custom.id_to_token(id);
        if theirs.as_deref() != Some(mine.as_str()) {
            bail!(
                "--tokenizer {} is another vocabulary than {description}'s: token {id} is {} \
                 there but {mine:?} in the model's own (the same size, other tokens: the model \
                 would read and write ids that mean other text)",
                path.display(),
                theirs.map_or("missing".into(), |t| format!("{t:?}")),
            );
        }
    }
    Ok(())
}

/// Seed of `--load-format dummy` weights (where the device's generator takes one).
const DUMMY_SEED: u64 = 0;

fn looks_like_path(spec: &str) -> bool {
    spec.ends_with(".gguf")
        || spec.starts_with('.')
        || spec.starts_with('/')
        || spec.starts_with('~')
        || spec.matches('/').count() > 1
}

/// Refuses, with what it is, a path that exists but is no model: a device, a FIFO or socket
/// (which would block or never end), or a lone safetensors file (a safetensors model is a
/// directory, with its config.json and tokenizer.json).
fn check_model_path(p: &Path, spec: &str) -> Result<()> {
    let Ok(meta) = std::fs::metadata(p) else {
        return Ok(());
    };
    if !meta.is_file() && !meta.is_dir() {
        bail!(
            "--model {spec} is not a regular file or directory (a device, FIFO or socket): give \
             a .gguf file, a model directory or a Hugging Face repo id"
        );
    }
    if meta.is_file() {
        let mut head = [0u8; 9];
        let n = std::fs::File::open(p)
            .and_then(|mut f| std::io::Read::read(&mut f, &mut head))
            .unwrap_or(0);
        let safetensors_header = n == 9 && head.get(8) == Some(&b'{') && !head.starts_with(b"GGUF");
        if spec.ends_with(".safetensors") || safetensors_header {
            let dir = p.parent().map_or(".".into(), |d| d.display().to_string());
            bail!(
                "--model {spec} is a safetensors file: give the directory holding it with its \
                 config.json and tokenizer.json (e.g. --model {dir})"
            );
        }
    }
    Ok(())
}

fn load_gguf(
    path: &Path,
    args: &ModelOptions,
    device: &Device,
    dtype: DType,
) -> Result<(Llama, TextTokenizer, String, WeightSource)> {
    if let Err(e) = super::gguf_check::check_file(path)
        .with_context(|| format!("cannot open model file {}", path.display()))?
    {
        bail!(
            "{} is not a readable GGUF model file ({e}): it is truncated or corrupt",
            path.display()
        );
    }
    let mut f = std::fs::File::open(path)
        .with_context(|| format!("cannot open model file {}", path.display()))?;
    let content = gguf_file::Content::read(&mut f).map_err(|e| {
        // candle may append a backtrace to the message: keep its first line.
        let e = e.to_string().lines().next().unwrap_or_default().to_string();
        if e.contains("unknown dtype") {
            anyhow::anyhow!(
                "{} uses an unsupported tensor type ({e}); kvq reads F32, F16, BF16, \
                 Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 and Q2_K..Q8_K",
                path.display()
            )
        } else {
            anyhow::anyhow!(
                "{} is not a readable GGUF model file ({e}): it is truncated or corrupt",
                path.display()
            )
        }
    })?;
    let cfg = ModelConfig::from_gguf(&content).with_context(|| format!("in {}", path.display()))?;
    let cfg = args.with_context_window(cfg)?;
    let tokenizer = TextTokenizer::from_gguf(&content)
        .with_context(|| format!("tokenizer of {}", path.display()))?;
    let math = if args.dequantize {
        GgufMath::Dense
    } else if args.keep_quantized {
        GgufMath::Candle
    } else if device.is_cpu() {
        GgufMath::Blocks
    } else if dense_fits(&content, dtype, device) {
        // Batched decode then multiplies on tensor cores: on an H100, 64 x 512 decodes at
        // 28.8K tok/s against 12.9K with the Q4_1 blocks (README, GPU figures).
        GgufMath::Dense
    } else {
        GgufMath::Candle
    };
    let mut w = Weights::gguf(path, &cfg, content, device, dtype, math)?;
    let model = Llama::load(&cfg, &mut w)?;
    let source = WeightSource::Gguf(path.to_path_buf());
    Ok((model, tokenizer, path.display().to_string(), source))
}

/// Whether a GGUF model's weights, dequantized to `dtype`, take at most a quarter of the
/// device's free memory (the GPU default then dequantizes them). Unknown free memory: no.
fn dense_fits(content: &gguf_file::Content, dtype: DType, device: &Device) -> bool {
    let elems = content
        .tensor_infos
        .values()
        .map(|t| t.shape.elem_count())
        .fold(0usize, usize::saturating_add);
    let bytes = elems.saturating_mul(dtype.size_in_bytes()) as u64;
    crate::device::free_bytes(device).is_some_and(|free| bytes <= free / 4)
}

fn load_safetensors(
    files: &ModelFiles,
    args: &ModelOptions,
    device: &Device,
    dtype: DType,
    spec: &str,
) -> Result<(Llama, TextTokenizer, String, WeightSource)> {
    if args.dequantize || args.keep_quantized {
        bail!("--dequantize / --keep-quantized apply to GGUF models only ({spec} is safetensors)");
    }
    let cfg = args.with_context_window(ModelConfig::from_hf_file(&files.config)?)?;
    let mut extra: Vec<&Path> = vec![files.config.as_path()];
    if let Some(g) = &files.generation_config {
        extra.push(g.as_path());
    }
    let tokenizer =
        TextTokenizer::from_files(&files.tokenizer, files.tokenizer_config.as_deref(), &extra)?;
    let mut w = Weights::safetensors(&files.weights, &cfg, device, dtype)?;
    let model = Llama::load(&cfg, &mut w)?;
    let mut files_hashed = vec![files.config.clone()];
    files_hashed.extend(files.weights.iter().cloned());
    Ok((
        model,
        tokenizer,
        spec.to_string(),
        WeightSource::Safetensors(files_hashed),
    ))
}

fn load_dummy(args: &ModelOptions, device: &Device, dtype: DType) -> Result<LoadedModel> {
    let config: &PathBuf = args
        .config
        .as_ref()
        .context("--load-format dummy needs --config config.json (the model shape)")?;
    if args.dequantize || args.keep_quantized {
        bail!("--dequantize / --keep-quantized have no meaning with --load-format dummy");
    }
    let cfg = args.with_context_window(ModelConfig::from_hf_file(config)?)?;
    let tokenizer = match (&args.tokenizer, &args.model) {
        (Some(t), _) => TextTokenizer::from_files(t, None, &[])?,
        (None, Some(m)) if Path::new(m).is_dir() => {
            let files = hub::model_files_in_dir(Path::new(m))?;
            TextTokenizer::from_files(&files.tokenizer, files.tokenizer_config.as_deref(), &[])?
        }
        _ => {
            // Any tokenizer works for random weights; the default model's keeps runs offline.
            let path = fetch::default_model()?;
            let mut f = std::fs::File::open(&path)?;
            let content = gguf_file::Content::read(&mut f)?;
            TextTokenizer::from_gguf(&content)?
        }
    };
    if tokenizer.vocab_size() > cfg.vocab_size {
        bail!(
            "the tokenizer has {} tokens but --config gives vocab_size {}",
            tokenizer.vocab_size(),
            cfg.vocab_size
        );
    }
    let mut w = Weights::dummy(&cfg, device, dtype, DUMMY_SEED)?;
    let model = Llama::load(&cfg, &mut w)?;
    Ok(LoadedModel {
        model,
        tokenizer,
        chat_template: None,
        description: format!("dummy weights shaped by {}", config.display()),
        template_owner: format!("dummy weights shaped by {}", config.display()),
        source: WeightSource::Dummy {
            config: config.clone(),
            seed: DUMMY_SEED,
            dtype,
            device: device.clone(),
        },
        weight_math: WeightMath::Dense,
    })
}
