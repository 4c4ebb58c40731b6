//! The GGUF tokenizer and the chat template against the reference data of the default model.

use std::path::PathBuf;

use candle_core::quantized::gguf_file;
use kvq::model::chat::{ChatTemplate, Message};
use kvq::model::tokenizer::TextTokenizer;
use serde_json::Value;

use crate::common::reference_dir;

/// The default model, fetched first if no test has yet (these tests may run before any other).
fn model_path() -> PathBuf {
    kvq::model::fetch::default_model().unwrap()
}

fn tokenizer() -> TextTokenizer {
    let path = model_path();
    let mut file = std::fs::File::open(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let content = gguf_file::Content::read(&mut file).unwrap();
    TextTokenizer::from_gguf(&content).unwrap()
}

fn facts() -> Value {
    serde_json::from_str(
        &std::fs::read_to_string(reference_dir().join("smollm2-model-facts.json")).unwrap(),
    )
    .unwrap()
}

fn greedy_cases() -> Vec<Value> {
    std::fs::read_to_string(reference_dir().join("smollm2-greedy.jsonl"))
        .unwrap()
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

fn template(tok: &TextTokenizer) -> ChatTemplate {
    ChatTemplate::new(
        tok.chat_template().expect("the GGUF has a chat template"),
        tok.bos_token().map(|(_, t)| t),
        tok.eos_token(),
    )
    .unwrap()
}

#[test]
fn special_tokens_and_metadata() {
    let tok = tokenizer();
    let f = facts();
    let t = &f["tokenizer"];
    assert_eq!(
        tok.bos_token(),
        Some((1, t["bos_token"].as_str().unwrap().to_string()))
    );
    assert_eq!(tok.eos_token_ids(), &[2]);
    assert_eq!(tok.eos_token().as_deref(), t["eos_token"].as_str());
    assert_eq!(tok.vocab_size(), 49152);
    assert_eq!(tok.chat_template(), t["chat_template"].as_str());
    for (id, text) in t["special_tokens"].as_object().unwrap() {
        let id: u32 = id.parse().unwrap();
        assert_eq!(tok.id_to_token(id).as_deref(), text.as_str());
        assert_eq!(
            tok.encode(text.as_str().unwrap(), false).unwrap(),
            vec![id],
            "{text}"
        );
    }
    // SmolLM2 says add_bos_token = false: no BOS even when asked.
    assert_eq!(
        tok.encode("Hi", true).unwrap(),
        tok.encode("Hi", false).unwrap()
    );
}

#[test]
fn round_trips_match_reference() {
    let tok = tokenizer();
    let f = facts();
    let cases = f["tokenizer_roundtrip"].as_array().unwrap();
    assert!(cases.len() >= 9);
    for case in cases {
        let text = case["text"].as_str().unwrap();
        let want = ids(&case["ids"]);
        assert_eq!(tok.encode(text, false).unwrap(), want, "encode {text:?}");
        assert_eq!(tok.decode(&want, false).unwrap(), text, "decode {text:?}");
    }
}

#[test]
fn digits_are_isolated_before_byte_level() {
    let tok = tokenizer();
    let f = facts();
    let ex = &f["tokenizer"]["pre_tokenizer_difference_example"];
    let text = ex["text"].as_str().unwrap();
    let got = tok.encode(text, false).unwrap();
    assert_eq!(got, ids(&ex["reference_ids"]));
    assert_ne!(got, ids(&ex["plain_bytelevel_ids"]));
    let tokens: Vec<String> = got.iter().map(|&i| tok.id_to_token(i).unwrap()).collect();
    let want: Vec<String> = ex["reference_tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_str().unwrap().to_string())
        .collect();
    assert_eq!(tokens, want);
}

#[test]
fn greedy_prompts_encode_exactly() {
    let tok = tokenizer();
    let chat = template(&tok);
    let cases = greedy_cases();
    assert_eq!(cases.len(), 12);
    let mut n_chat = 0;
    for case in &cases {
        let id = case["id"].as_str().unwrap();
        let text = if case["chat_template"].as_bool().unwrap() {
            n_chat += 1;
            let messages: Vec<Message> = serde_json::from_value(case["messages"].clone()).unwrap();
            let rendered = chat.render(&messages, true).unwrap();
            assert_eq!(
                rendered,
                case["rendered_prompt"].as_str().unwrap(),
                "{id}: rendering"
            );
            rendered
        } else {
            case["prompt"].as_str().unwrap().to_string()
        };
        assert_eq!(
            tok.encode(&text, true).unwrap(),
            ids(&case["input_ids"]),
            "{id}: ids"
        );
    }
    assert_eq!(n_chat, 9);
}

#[test]
fn corpus_prefix_matches_reference_ids() {
    let tok = tokenizer();
    let corpus = std::fs::read_to_string(reference_dir().join("corpus.txt")).unwrap();
    let want: Vec<u32> =
        std::fs::read_to_string(reference_dir().join("corpus-first65536-token-ids.txt"))
            .unwrap()
            .split_whitespace()
            .map(|x| x.parse().unwrap())
            .collect();
    assert_eq!(want.len(), 65536);
    let got = tok.encode(&corpus, false).unwrap();
    assert!(got.len() > want.len());
    if let Some(i) = (0..want.len()).find(|&i| got[i] != want[i]) {
        panic!(
            "first corpus mismatch at token {i}: got {:?}, want {:?}",
            &got[i..i + 8],
            &want[i..i + 8]
        );
    }
}

#[test]
fn tokenizer_json_files_give_the_same_ids() {
    let gguf = tokenizer();
    let dir = tempfile::tempdir().unwrap();
    let tj = dir.path().join("tokenizer.json");
    gguf.inner().save(&tj, false).unwrap();
    let tc = dir.path().join("tokenizer_config.json");
    let template = gguf.chat_template().unwrap();
    std::fs::write(
        &tc,
        serde_json::json!({"bos_token": "<|im_start|>", "eos_token": {"content": "<|im_end|>"},
            "add_bos_token": false, "chat_template": template})
        .to_string(),
    )
    .unwrap();
    let gc = dir.path().join("generation_config.json");
    std::fs::write(&gc, r#"{"eos_token_id": [2, 0]}"#).unwrap();
    let cfg = dir.path().join("config.json");
    std::fs::write(&cfg, r#"{"eos_token_id": 2}"#).unwrap();
    let tok = TextTokenizer::from_files(&tj, Some(&tc), &[&cfg, &gc]).unwrap();
    assert_eq!(tok.eos_token_ids(), &[2, 0]);
    assert_eq!(tok.eos_token().as_deref(), Some("<|im_end|>"));
    assert_eq!(tok.bos_token(), Some((1, "<|im_start|>".to_string())));
    assert_eq!(tok.chat_template(), Some(template));
    for case in greedy_cases() {
        let text = case["rendered_prompt"].as_str().unwrap();
        assert_eq!(tok.encode(text, true).unwrap(), ids(&case["input_ids"]));
    }
    // A model that asks for a BOS gets exactly one, also when the text already starts with it.
    std::fs::write(
        &tc,
        r#"{"bos_token": "<|im_start|>", "add_bos_token": true}"#,
    )
    .unwrap();
    let tok = TextTokenizer::from_files(&tj, Some(&tc), &[]).unwrap();
    assert_eq!(tok.encode("Hi", true).unwrap(), vec![1, 26843]);
    assert_eq!(tok.encode("<|im_start|>Hi", true).unwrap(), vec![1, 26843]);
    assert_eq!(tok.encode("Hi", false).unwrap(), vec![26843]);
}

#[test]
fn unsupported_gguf_tokenizers_are_refused_by_name() {
    let path = model_path();
    let mut file = std::fs::File::open(&path).unwrap();
    let mut content = gguf_file::Content::read(&mut file).unwrap();
    content.metadata.insert(
        "tokenizer.ggml.pre".into(),
        gguf_file::Value::String("jais".into()),
    );
    let err = TextTokenizer::from_gguf(&content)
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains("\"jais\""), "{err}");
    content.metadata.insert(
        "tokenizer.ggml.model".into(),
        gguf_file::Value::String("bert".into()),
    );
    let err = TextTokenizer::from_gguf(&content)
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains("\"bert\""), "{err}");
    content.metadata.remove("tokenizer.ggml.model");
    assert!(TextTokenizer::from_gguf(&content).is_err());
}
