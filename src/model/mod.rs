//! Models: where weights come from (GGUF, safetensors, the Hub, dummy), their config, the
//! tokenizer and chat template, and the one Llama-family decoder.

pub mod chat;
pub mod config;
pub mod fetch;
pub mod fingerprint;
pub mod gguf_check;
pub mod hub;
pub mod llama;
pub mod load;
pub mod tokenizer;
pub mod weights;
