#!/usr/bin/env python3
"""Builds the tiny random-weight models of fixtures/tiny/ and transformers' answers for them.

For each architecture kvq runs beside the Llama family (Gemma 2, Gemma 3 text, Phi-3, Mistral
with a sliding window, Qwen2 with sliding layers) this makes a seeded model of a few layers
(hidden <= 256; the Gemma 3 one has head_dim 256) whose windows are short (16 tokens), so
prompts three times longer than a window stay short. Each model is written twice:

- `fixtures/tiny/<arch>/hf/`: config.json, model.safetensors (f16 values), tokenizer.json,
  tokenizer_config.json, generation_config.json — what `save_pretrained` writes;
- `fixtures/tiny/<arch>/model.gguf`: the same values as a GGUF file laid out as llama.cpp's
  converter lays them out (Q/K rows permuted for the `llama` architecture, Gemma norms stored
  as 1 + w, Phi-3's fused projections), F16 matrices and F32 vectors, and the SentencePiece
  vocabulary (tokens, scores, token types) as `tokenizer.ggml.*`.

Weights are drawn, then rounded to f16, so the f16 files hold exactly the values transformers
ran with in float32. `reference.json` records, per prompt, transformers' token ids, its greedy
continuation (full recomputation every step, eager attention, float32), the last prompt
position's logits and each step's top-1/top-2 margin; and per tokenizer a multilingual text
with byte-fallback characters and its ids, plus one chat rendering.

Two SentencePiece models (BPE with byte fallback) are trained here on the start of
/work/shared/reference/corpus.txt plus a few multilingual lines: a Gemma-style one (pad 0, eos 1,
bos 2, unk 3, no dummy prefix, <start_of_turn>/<end_of_turn>) for the Gemma models and a
Llama-style one (unk 0, bos 1, eos 2, dummy prefix) for the others.

CI never runs this: the outputs are committed. Needs torch, transformers, sentencepiece, gguf
(the committed fixtures: torch 2.15.0, transformers 5.24.0, sentencepiece 0.2.3, gguf 0.19.0,
numpy 2.4.6, protobuf 7.36.2; torch's default PyPI wheel reproduces the Phi-3, Mistral and Qwen2
files byte for byte, the Gemma logits to within 1e-5). `--only` rebuilds the named architectures
and leaves the others' files untouched.
Usage: python3 scripts/make_tiny_models.py [--corpus PATH] [--out fixtures/tiny] [--only ARCH...]
"""

import argparse
import json
import os
import shutil
import tempfile

import numpy as np
import sentencepiece as spm
import torch
import transformers
from transformers import AutoModelForCausalLM

import gguf

SEED = 1234
WINDOW = 16
# Added to the Gemma models' final norm weight (used as 1 + w): their tied embeddings are tiny
# (see `randomize`), so without a gain the logits are too, and the first greedy steps are
# near-ties (top-two margins below 0.05) that no quantized cache could be checked against.
GEMMA_FINAL_NORM_GAIN = 30.0
# Multiplies Phi-3's final norm weight. With a window its logits (up to ±3.6 otherwise) have
# near-ties (top-two margins below 0.05) at the first or second greedy step of both prompts, so the
# 8-bit cache test would compare a single token; scaled, nine more. The scale leaves the argmax.
PHI3_FINAL_NORM_SCALE = 2.5
NEW_TOKENS = 12

MULTILINGUAL = [
    "Der schnelle braune Fuchs springt über den faulen Hund. Größe, Straße, Äpfel.",
    "Le cœur a ses raisons que la raison ne connaît point. Où est l'élève ?",
    "Быстрая коричневая лиса прыгает через ленивую собаку.",
    "Η γρήγορη καφέ αλεπού πηδάει πάνω από τον τεμπέλη σκύλο.",
    "敏捷的棕色狐狸跳过了懒狗。東京は日本の首都です。",
    "El veloz murciélago hindú comía feliz cardillo y kiwi.",
]

# Text whose rare characters (CJK, emoji, symbols) fall back to bytes with a small vocabulary.
TOKENIZER_TEXT = (
    "Hello world!  Two  spaces, tabs\tand\nnew lines. Numbers 12345 and 3.14159.\n"
    "Grüße aus München — naïve café, Ærøskøbing. Привет, мир! Γειά σου κόσμε.\n"
    "日本語のテキスト、中文文本。한국어 텍스트. Emoji: 🙂🚀 and symbols ∑∫√ ≠ ≤ ≥ ™ ©.\n"
    "<start_of_turn> is a control token only when written exactly."
)

PROMPTS = [
    "The Library of Congress held a workshop on electronic texts in June of 1992, and the "
    "participants discussed how scholars, librarians and publishers would use the new "
    "electronic editions of historical documents in their daily work and research.",
    "Electronic texts raise questions of encoding, of markup and of access: who will pay for "
    "the conversion of printed collections, how will the files be kept readable for decades, "
    "and which standards will let one program read what another program wrote?",
]

CHAT = [
    {"role": "user", "content": "What is a sliding window?"},
    {"role": "assistant", "content": "A cache that keeps only the most recent tokens."},
    {"role": "user", "content": "Why does it save memory?"},
]

# A Gemma-style chat template: BOS, turns as <start_of_turn>role\n...<end_of_turn>\n, the
# assistant's role called "model", a system message folded into the first user turn.
GEMMA_TEMPLATE = (
    "{{ bos_token }}"
    "{% if messages[0]['role'] == 'system' %}"
    "{% set first_user_prefix = messages[0]['content'] | trim + '\n\n' %}"
    "{% set loop_messages = messages[1:] %}"
    "{% else %}{% set first_user_prefix = '' %}{% set loop_messages = messages %}{% endif %}"
    "{% for message in loop_messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}"
    "{% if message['role'] == 'assistant' %}{% set role = 'model' %}"
    "{% else %}{% set role = message['role'] %}{% endif %}"
    "{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') "
    "+ message['content'] | trim + '<end_of_turn>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)

# A Mistral-style [INST] template for the Llama-style tokenizer.
INST_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% else %}{{ message['content'] + eos_token }}{% endif %}{% endfor %}"
)


def training_text(corpus: str) -> str:
    with open(corpus, encoding="utf-8") as f:
        text = f.read(60_000)
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return "\n".join(lines + MULTILINGUAL * 20)


def train_sp(text: str, out_prefix: str, gemma: bool) -> str:
    """Trains a BPE SentencePiece model with byte fallback; returns the .model path."""
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False, encoding="utf-8") as f:
        f.write(text)
        path = f.name
    common = dict(
        input=path,
        model_prefix=out_prefix,
        model_type="bpe",
        vocab_size=640,
        byte_fallback=True,
        character_coverage=0.999,
        split_digits=True,
        remove_extra_whitespaces=False,
        normalization_rule_name="identity",
        num_threads=1,
        allow_whitespace_only_pieces=True,
        max_sentencepiece_length=12,
    )
    if gemma:
        spm.SentencePieceTrainer.train(
            pad_id=0,
            eos_id=1,
            bos_id=2,
            unk_id=3,
            pad_piece="<pad>",
            eos_piece="<eos>",
            bos_piece="<bos>",
            unk_piece="<unk>",
            add_dummy_prefix=False,
            user_defined_symbols=["<mask>", "<start_of_turn>", "<end_of_turn>"],
            **common,
        )
    else:
        spm.SentencePieceTrainer.train(
            unk_id=0, bos_id=1, eos_id=2, pad_id=-1, add_dummy_prefix=True, **common
        )
    os.unlink(path)
    return out_prefix + ".model"


def hf_tokenizer(sp_model: str, gemma: bool):
    """transformers' own conversion of the SentencePiece model (a tokenizers BPE)."""
    d = tempfile.mkdtemp()
    shutil.copy(sp_model, os.path.join(d, "tokenizer.model"))
    if gemma:
        tok = transformers.GemmaTokenizer.from_pretrained(d)
        tok.chat_template = GEMMA_TEMPLATE
    else:
        tok = transformers.LlamaTokenizer.from_pretrained(d)
        tok.chat_template = INST_TEMPLATE
    shutil.rmtree(d)
    # The conversion must not have invented tokens (its defaults name BOS/EOS differently).
    assert len(tok) == spm.SentencePieceProcessor(model_file=sp_model).get_piece_size(), len(tok)
    return tok


def gguf_tokenizer(w: gguf.GGUFWriter, sp_model: str, tok, gemma: bool, eot: int | None):
    sp = spm.SentencePieceProcessor(model_file=sp_model)
    tokens, scores, types = [], [], []
    for i in range(sp.get_piece_size()):
        tokens.append(sp.id_to_piece(i))
        scores.append(sp.get_score(i))
        if sp.is_unknown(i):
            types.append(gguf.TokenType.UNKNOWN)
        elif sp.is_control(i):
            types.append(gguf.TokenType.CONTROL)
        elif sp.is_byte(i):
            types.append(gguf.TokenType.BYTE)
        elif sp.is_unused(i):
            types.append(gguf.TokenType.UNUSED)
        elif tokens[-1] in ("<start_of_turn>", "<end_of_turn>"):
            # llama.cpp's Gemma converter marks these as control tokens.
            types.append(gguf.TokenType.CONTROL)
        else:
            types.append(gguf.TokenType.NORMAL)
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(sp.bos_id())
    w.add_eos_token_id(sp.eos_id())
    w.add_unk_token_id(sp.unk_id())
    if sp.pad_id() >= 0:
        w.add_pad_token_id(sp.pad_id())
    if eot is not None:
        w.add_eot_token_id(eot)
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
    w.add_add_space_prefix(not gemma)
    w.add_chat_template(tok.chat_template)


def arch_configs(vocab: int) -> dict:
    """HF configs of the tiny models, with the GGUF architecture name each is written as."""
    base = dict(vocab_size=vocab, max_position_embeddings=256, rms_norm_eps=1e-6,
                initializer_range=0.1)
    # head_dim 64 or 256: the KV formats group along the head dimension (64 by default).
    small = dict(hidden_size=64, intermediate_size=128, num_attention_heads=2,
                 num_key_value_heads=1, head_dim=64)
    return {
        "gemma2": ("gemma2", transformers.Gemma2Config(
            num_hidden_layers=3, query_pre_attn_scalar=64, sliding_window=WINDOW,
            attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
            hidden_activation="gelu_pytorch_tanh", rope_theta=10000.0, pad_token_id=0,
            eos_token_id=[1, 6], bos_token_id=2, **small, **base)),
        "gemma3": ("gemma3", transformers.Gemma3TextConfig(
            hidden_size=64, intermediate_size=128, num_hidden_layers=3,
            num_attention_heads=2, num_key_value_heads=1, head_dim=256,
            query_pre_attn_scalar=256, sliding_window=WINDOW,
            layer_types=["sliding_attention", "sliding_attention", "full_attention"],
            rope_theta=100000.0, rope_local_base_freq=10000.0,
            final_logit_softcapping=None, attn_logit_softcapping=None,
            pad_token_id=0, eos_token_id=[1, 6], bos_token_id=2, **base)),
        "phi3": ("phi3", transformers.Phi3Config(
            hidden_size=128, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=2, num_key_value_heads=1, sliding_window=WINDOW,
            rope_theta=10000.0, tie_word_embeddings=False, pad_token_id=None,
            bos_token_id=1, eos_token_id=2, **base)),
        "mistral": ("llama", transformers.MistralConfig(
            num_hidden_layers=2, sliding_window=WINDOW, rope_theta=10000.0,
            tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, **small, **base)),
        "qwen2": ("qwen2", transformers.Qwen2Config(
            num_hidden_layers=3, use_sliding_window=True, sliding_window=WINDOW,
            max_window_layers=1, rope_theta=10000.0, tie_word_embeddings=True,
            bos_token_id=1, eos_token_id=2,
            **{k: v for k, v in small.items() if k != "head_dim"}, **base)),
    }


def layer_is_sliding(model) -> list[bool]:
    cfg = model.config
    types = getattr(cfg, "layer_types", None)
    if types is not None:
        return [t == "sliding_attention" for t in types]
    return [cfg.sliding_window is not None] * cfg.num_hidden_layers


def randomize(model, name: str):
    """Seeded weights rounded to f16; norm weights around 1 (Gemma: around 0, used as 1 + w)."""
    gemma = name.startswith("gemma")
    g = torch.Generator().manual_seed(SEED)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith("norm.weight"):
                x = torch.randn(p.shape, generator=g) * 0.1 + (0.0 if gemma else 1.0)
                if gemma and pname == "model.norm.weight":
                    x = x + GEMMA_FINAL_NORM_GAIN
                if name == "phi3" and pname == "model.norm.weight":
                    x = x * PHI3_FINAL_NORM_SCALE
            elif pname.endswith(".bias"):
                x = torch.randn(p.shape, generator=g) * 0.1
            elif gemma and "embed_tokens" in pname:
                # Scaled by sqrt(hidden) on the way in: keep the token's own embedding from
                # dominating the tied output projection (greedy would repeat the last token).
                x = torch.randn(p.shape, generator=g) * 0.01
            else:
                x = torch.randn(p.shape, generator=g) * 0.1
            p.copy_(x.half().float())


def permute_qk(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's row permutation of Q/K for the `llama` GGUF architecture."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(path: str, name: str, arch: str, model, sp_model: str, tok, eot):
    cfg = model.config
    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    gemma = name.startswith("gemma")
    w = gguf.GGUFWriter(path, arch)
    w.add_name(f"kvq tiny {name}")
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_dimension_count(head_dim)
    rope = rope_thetas(cfg)
    w.add_rope_freq_base(rope["full"])
    sliding = layer_is_sliding(model)
    if any(sliding):
        w.add_sliding_window(cfg.sliding_window)
        if name != "phi3":  # llama.cpp's Phi-3 converter writes the window alone
            w.add_array(f"{arch}.attention.sliding_window_pattern", sliding)
    if name == "gemma3":
        w.add_float32(f"{arch}.rope.freq_base_swa", rope["sliding"])
    if name == "gemma2":
        w.add_float32(f"{arch}.attn_logit_softcapping", cfg.attn_logit_softcapping)
        w.add_float32(f"{arch}.final_logit_softcapping", cfg.final_logit_softcapping)
    gguf_tokenizer(w, sp_model, tok, gemma, eot)

    def put(gname, x, is_norm=False):
        if is_norm and gemma:
            x = x + 1.0  # llama.cpp stores Gemma norms as 1 + w
        x = np.ascontiguousarray(x)
        w.add_tensor(gname, x.astype(np.float32 if x.ndim == 1 else np.float16))

    put("token_embd.weight", sd["model.embed_tokens.weight"])
    put("output_norm.weight", sd["model.norm.weight"], True)
    if "lm_head.weight" in sd and not cfg.tie_word_embeddings:
        put("output.weight", sd["lm_head.weight"])
    for l in range(cfg.num_hidden_layers):
        p = f"model.layers.{l}."
        b = f"blk.{l}."
        put(b + "attn_norm.weight", sd[p + "input_layernorm.weight"], True)
        put(b + "attn_output.weight", sd[p + "self_attn.o_proj.weight"])
        put(b + "ffn_down.weight", sd[p + "mlp.down_proj.weight"])
        if name == "phi3":
            put(b + "attn_qkv.weight", sd[p + "self_attn.qkv_proj.weight"])
            put(b + "ffn_up.weight", sd[p + "mlp.gate_up_proj.weight"])
        else:
            q, k = sd[p + "self_attn.q_proj.weight"], sd[p + "self_attn.k_proj.weight"]
            if arch == "llama":
                q = permute_qk(q, cfg.num_attention_heads)
                k = permute_qk(k, cfg.num_key_value_heads)
            put(b + "attn_q.weight", q)
            put(b + "attn_k.weight", k)
            put(b + "attn_v.weight", sd[p + "self_attn.v_proj.weight"])
            put(b + "ffn_gate.weight", sd[p + "mlp.gate_proj.weight"])
            put(b + "ffn_up.weight", sd[p + "mlp.up_proj.weight"])
            for x in "qkv":
                if p + f"self_attn.{x}_proj.bias" in sd:
                    put(b + f"attn_{x}.bias", sd[p + f"self_attn.{x}_proj.bias"])
        if gemma:
            put(b + "post_attention_norm.weight", sd[p + "post_attention_layernorm.weight"], True)
            put(b + "ffn_norm.weight", sd[p + "pre_feedforward_layernorm.weight"], True)
            put(b + "post_ffw_norm.weight", sd[p + "post_feedforward_layernorm.weight"], True)
        else:
            put(b + "ffn_norm.weight", sd[p + "post_attention_layernorm.weight"], True)
        if name == "gemma3":
            put(b + "attn_q_norm.weight", sd[p + "self_attn.q_norm.weight"], True)
            put(b + "attn_k_norm.weight", sd[p + "self_attn.k_norm.weight"], True)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def rope_thetas(cfg) -> dict:
    """RoPE bases of full and sliding layers, from either config layout transformers uses."""
    params = getattr(cfg, "rope_parameters", None)
    if isinstance(params, dict) and "full_attention" in params:
        return {
            "full": params["full_attention"]["rope_theta"],
            "sliding": params["sliding_attention"]["rope_theta"],
        }
    if isinstance(params, dict) and "rope_theta" in params:
        return {"full": params["rope_theta"], "sliding": params["rope_theta"]}
    full = cfg.rope_theta
    return {"full": full, "sliding": getattr(cfg, "rope_local_base_freq", full)}


@torch.no_grad()
def greedy(model, ids: list[int], n: int, eos: set[int]):
    out, margins, first_logits = [], [], None
    seq = list(ids)
    for step in range(n):
        logits = model(torch.tensor([seq])).logits[0, -1].float()
        if step == 0:
            first_logits = logits.tolist()
        top = torch.topk(logits, 2)
        margins.append(float(top.values[0] - top.values[1]))
        t = int(top.indices[0])
        out.append(t)
        seq.append(t)
        if t in eos:
            break
    return out, margins, first_logits


def build(name: str, arch: str, cfg, sp_model: str, gemma: bool, out_dir: str):
    torch.manual_seed(SEED)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager",
                                             dtype=torch.float32)
    model.eval()
    randomize(model, name)
    tok = hf_tokenizer(sp_model, gemma)
    eot = tok.convert_tokens_to_ids("<end_of_turn>") if gemma else None
    d = os.path.join(out_dir, name)
    shutil.rmtree(d, ignore_errors=True)
    os.makedirs(d)
    hf_dir = os.path.join(d, "hf")
    half = AutoModelForCausalLM.from_config(cfg, dtype=torch.float16)
    half.load_state_dict({k: v.half() for k, v in model.state_dict().items()})
    half.save_pretrained(hf_dir, safe_serialization=True)
    tok.save_pretrained(hf_dir)
    for extra in ("tokenizer.model", "special_tokens_map.json"):
        p = os.path.join(hf_dir, extra)
        if os.path.exists(p):
            os.unlink(p)
    # The temporary path the tokenizer was converted from means nothing once saved.
    tc_path = os.path.join(hf_dir, "tokenizer_config.json")
    with open(tc_path, encoding="utf-8") as f:
        tc = json.load(f)
    tc.pop("vocab_file", None)
    tc["add_bos_token"] = True  # as the model's GGUF says (transformers 5 leaves it out)
    with open(tc_path, "w", encoding="utf-8") as f:
        json.dump(tc, f, indent=2)
    write_gguf(os.path.join(d, "model.gguf"), name, arch, model, sp_model, tok, eot)

    eos = set(cfg.eos_token_id if isinstance(cfg.eos_token_id, list) else [cfg.eos_token_id])
    cases = []
    for text in PROMPTS:
        ids = [tok.bos_token_id] + tok(text, add_special_tokens=False)["input_ids"]
        assert len(ids) >= 3 * WINDOW, f"{name}: prompt of {len(ids)} tokens is too short"
        gen, margins, logits = greedy(model, ids, NEW_TOKENS, eos)
        cases.append({"prompt": text, "input_ids": ids, "generated_ids": gen,
                      "margins": margins, "last_logits": logits})
    sp = spm.SentencePieceProcessor(model_file=sp_model)
    tok_ids = tok(TOKENIZER_TEXT, add_special_tokens=False)["input_ids"]
    if not gemma:
        # The special-token string aside, transformers' conversion agrees with SentencePiece.
        plain = TOKENIZER_TEXT.split("<start_of_turn>")[0]
        assert tok(plain, add_special_tokens=False)["input_ids"] == sp.encode(plain), name
    chat_text = tok.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    ref = {
        "generator": f"transformers {transformers.__version__}, torch {torch.__version__}, "
                     "float32, eager attention, greedy with full recomputation",
        "arch": name,
        "window": WINDOW,
        "sliding_layers": layer_is_sliding(model),
        "cases": cases,
        "tokenizer": {
            "text": TOKENIZER_TEXT,
            "ids": tok_ids,
            "decoded": tok.decode(tok_ids),
            "chat": CHAT,
            "chat_text": chat_text,
            "chat_ids": tok(chat_text, add_special_tokens=False)["input_ids"],
        },
    }
    with open(os.path.join(d, "reference.json"), "w", encoding="utf-8") as f:
        json.dump(ref, f, ensure_ascii=False, indent=1)
    print(f"{name}: {sum(len(c['input_ids']) for c in cases)} prompt tokens, "
          f"greedy {[c['generated_ids'] for c in cases]}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--corpus", default="/work/shared/reference/corpus.txt")
    ap.add_argument("--out", default="fixtures/tiny")
    ap.add_argument("--only", nargs="*", help="architectures to build (default: all)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    os.makedirs(args.out, exist_ok=True)
    text = training_text(args.corpus)
    work = tempfile.mkdtemp()
    sp = {
        True: train_sp(text, os.path.join(work, "gemma_sp"), True),
        False: train_sp(text, os.path.join(work, "llama_sp"), False),
    }
    vocab = spm.SentencePieceProcessor(model_file=sp[True]).get_piece_size()
    for name, (arch, cfg) in arch_configs(vocab).items():
        if args.only and name not in args.only:
            continue
        gemma = name.startswith("gemma")
        build(name, arch, cfg, sp[gemma], gemma, args.out)
    shutil.rmtree(work)


if __name__ == "__main__":
    main()
