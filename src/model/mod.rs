//! Models: where weights come from (GGUF, safetensors, the Hub, dummy), their config, the
//! tokenizer and chat template, and the one decoder (Llama family, Gemma 2/3, Phi-3).

pub mod chat;
pub mod config;
pub mod fetch;
pub mod fingerprint;
pub mod fused;
pub mod fused_cpu;
pub mod gemv;
pub mod gguf_check;
pub mod hub;
pub mod linear;
pub mod llama;
pub mod load;
pub mod options;
pub mod tokenizer;
pub mod tokenizer_spm;
pub mod weights;
