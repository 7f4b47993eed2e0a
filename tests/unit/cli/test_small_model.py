"""The model maker: deterministic files, loadable by transformers, and (e2e) served by vLLM."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
from safetensors import safe_open

from vllm_pd import cli
from vllm_pd.small_model import LoraSpec, ModelSpec, ModelSpecError, ensure_default_model, ensure_lora, write_model
from vllm_pd.small_model.lora import ADAPTER_FILES, write_lora
from vllm_pd.small_model.writer import MODEL_FILES

TINY = dict(layers=1, hidden=64, heads=2, kv_heads=1, head_dim=32, intermediate=128, vocab=600)


def _bytes(d: Path) -> dict[str, bytes]:
    return {name: (d / name).read_bytes() for name in MODEL_FILES}


def test_same_seed_gives_identical_files(tmp_path: Path) -> None:
    a = write_model(ModelSpec(seed=3, **TINY), tmp_path / "a")
    b = write_model(ModelSpec(seed=3, **TINY), tmp_path / "b")
    assert _bytes(a) == _bytes(b)


def test_different_seed_gives_different_weights(tmp_path: Path) -> None:
    a = write_model(ModelSpec(seed=1, **TINY), tmp_path / "a")
    b = write_model(ModelSpec(seed=2, **TINY), tmp_path / "b")
    with safe_open(a / "model.safetensors", "pt") as fa, safe_open(b / "model.safetensors", "pt") as fb:
        assert set(fa.keys()) == set(fb.keys())
        for key in ("lm_head.weight", "model.layers.0.self_attn.q_proj.weight"):
            assert not fa.get_tensor(key).equal(fb.get_tensor(key))


def test_weights_match_config_shapes(tmp_path: Path) -> None:
    d = write_model(ModelSpec(**TINY), tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    with safe_open(d / "model.safetensors", "pt") as f:
        assert list(f.get_slice("model.embed_tokens.weight").get_shape()) == [cfg["vocab_size"], cfg["hidden_size"]]
        assert list(f.get_slice("model.layers.0.self_attn.k_proj.weight").get_shape()) == [
            cfg["num_key_value_heads"] * cfg["head_dim"],
            cfg["hidden_size"],
        ]
        assert str(f.get_tensor("lm_head.weight").dtype) == "torch.bfloat16"


def test_transformers_loads_config_and_tokenizer(tmp_path: Path) -> None:
    from transformers import AutoConfig, AutoTokenizer

    d = write_model(ModelSpec(**TINY), tmp_path / "m")
    cfg = AutoConfig.from_pretrained(d)
    assert cfg.model_type == "llama" and cfg.num_key_value_heads == 1
    tok = AutoTokenizer.from_pretrained(d)
    assert len(tok) <= cfg.vocab_size
    text = "Hello world, prefill and decode: 12345 tokens!\n    return x * 2"
    ids = tok(text)["input_ids"]
    assert ids[0] == tok.bos_token_id
    assert tok.decode(ids, skip_special_tokens=True) == text
    chat = tok.apply_chat_template(
        [{"role": "user", "content": "hi there"}], tokenize=False, add_generation_prompt=True
    )
    assert chat == "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n"
    # the chat markers are single special tokens, not spelled out byte by byte
    assert tok.convert_tokens_to_ids("<|im_start|>") in tok(chat, add_special_tokens=False)["input_ids"]


def test_deepseek_v2_config_is_mla_and_dense(tmp_path: Path) -> None:
    from transformers import AutoConfig

    d = write_model(
        ModelSpec(
            arch="deepseek_v2",
            layers=2,
            hidden=64,
            heads=2,
            intermediate=128,
            vocab=600,
            kv_lora_rank=32,
            qk_rope_head_dim=16,
            qk_nope_head_dim=32,
            v_head_dim=32,
        ),
        tmp_path / "m",
    )
    cfg = AutoConfig.from_pretrained(d)
    assert cfg.model_type == "deepseek_v2" and cfg.kv_lora_rank == 32 and cfg.q_lora_rank is None
    assert cfg.first_k_dense_replace == cfg.num_hidden_layers
    with safe_open(d / "model.safetensors", "pt") as f:
        assert list(f.get_slice("model.layers.1.self_attn.kv_a_proj_with_mqa.weight").get_shape()) == [32 + 16, 64]


def test_sliding_window_model_has_gemma3_style_layer_types(tmp_path: Path) -> None:
    """A sliding window on all layers but every full_attention_every-th (HF layer_types, which
    vLLM's llama reads per layer); without one the config (and the cached model's key) is as before."""
    from transformers import AutoConfig

    d = write_model(
        ModelSpec(
            sliding_window=64, full_attention_every=2, layers=4, **{k: v for k, v in TINY.items() if k != "layers"}
        ),
        tmp_path / "m",
    )
    cfg = AutoConfig.from_pretrained(d)
    assert cfg.layer_types == ["sliding_attention", "full_attention"] * 2 and cfg.sliding_window == 64
    plain = json.loads((write_model(ModelSpec(**TINY), tmp_path / "p") / "config.json").read_text())
    assert "layer_types" not in plain and "sliding_window" not in plain
    assert ModelSpec().key() == "5a43f570519c"  # the default model's cached copy keeps its name


def test_nemotron_h_model_loads_strictly_and_answers_from_its_mamba_state(tmp_path: Path) -> None:
    """The state model of the e2e (test_connector_state_e2e): transformers takes every tensor under
    its NemotronH names, and the next token depends on the Mamba state - the prompt's last token
    stepped from zeroed conv and SSM states (the attention KV kept) answers otherwise for most
    prompts - so a state lost between prefill and decode shows in the e2e's token comparison."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoConfig, NemotronHForCausalLM

    spec = ModelSpec(arch="nemotron_h")
    d = write_model(spec, tmp_path / "m")
    cfg = AutoConfig.from_pretrained(d)
    assert cfg.hybrid_override_pattern == "M*M-" and spec.layer_pattern == "M*M-"
    model = NemotronHForCausalLM(cfg).float().eval()
    weights = {k.replace("backbone.", "model."): v.float() for k, v in load_file(d / "model.safetensors").items()}
    missing, unexpected = model.load_state_dict(weights, strict=False)
    assert not missing and not unexpected
    gen = torch.Generator().manual_seed(0)
    changed = 0
    for n in (40, 77, 130, 300, 512):
        ids = torch.randint(10, 4000, (1, n), generator=gen)
        with torch.no_grad():
            whole = int(model(ids).logits[0, -1].argmax())
            cache = model(ids[:, :-1], use_cache=True).past_key_values
            stepped = int(model(ids[:, -1:], past_key_values=cache, use_cache=True).logits[0, -1].argmax())
            assert stepped == whole  # the last token computed from the state after the others: same answer
            cache = model(ids[:, :-1], use_cache=True).past_key_values
            # vLLM keeps a Mamba layer's conv and SSM states in one block of its state group: both lost
            states = [
                s
                for layer in cache.layers
                for kind in ("conv_states", "recurrent_states")
                for s in getattr(layer, kind, {}).values()
                if s is not None
            ]
            assert states, "transformers keeps no recurrent state in its cache any more"
            for state in states:
                state.zero_()
            changed += int(model(ids[:, -1:], past_key_values=cache, use_cache=True).logits[0, -1].argmax()) != whole
    assert changed >= 3


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(arch="gpt2"), "--arch"),
        (dict(arch="nemotron_h", hidden=80), "--arch nemotron_h"),
        (dict(arch="nemotron_h", layers=1), "--arch nemotron_h"),
        (dict(heads=4, kv_heads=3), "--kv-heads"),
        (dict(head_dim=48), "--head-dim"),
        (dict(layers=0), "--layers"),
        (dict(vocab=100), "--vocab"),
        (dict(seed=-1), "--seed"),
        (dict(sliding_window=-1), "--sliding-window"),
        (dict(arch="deepseek_v2", sliding_window=64), "--sliding-window"),
        (dict(sliding_window=64, full_attention_every=1), "--full-attention-every"),
        (dict(sliding_window=64, layers=4, full_attention_every=5), "--full-attention-every"),
    ],
)
def test_bad_spec_names_the_argument(kwargs: dict, message: str) -> None:
    with pytest.raises(ModelSpecError, match=message):
        ModelSpec(**kwargs)


def test_cli_rejects_bad_args_and_existing_dir(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit, match="--head-dim"):
        cli.main(["make-model", str(tmp_path / "x"), "--head-dim", "48"])
    assert not (tmp_path / "x").exists()
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("mine")
    with pytest.raises(SystemExit, match="not empty"):
        cli.main(["make-model", str(tmp_path / "full")])
    assert (tmp_path / "full" / "keep.txt").read_text() == "mine"


def test_cli_writes_model(tmp_path: Path) -> None:
    assert (
        cli.main(
            [
                "make-model",
                str(tmp_path / "m"),
                "--layers",
                "1",
                "--hidden",
                "64",
                "--heads",
                "2",
                "--kv-heads",
                "1",
                "--head-dim",
                "32",
                "--intermediate",
                "128",
                "--vocab",
                "600",
            ]
        )
        == 0
    )
    assert json.loads((tmp_path / "m" / "config.json").read_text())["num_hidden_layers"] == 1


def test_ensure_default_model_concurrent_callers(tmp_path: Path) -> None:
    results: list[Path] = []
    threads = [
        threading.Thread(target=lambda: results.append(ensure_default_model(cache_dir=tmp_path))) for _ in range(3)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(results)) == 1 and len(results) == 3
    assert all((results[0] / name).is_file() for name in MODEL_FILES)
    assert [p.name for p in tmp_path.iterdir()] == [results[0].name]  # no temp dirs left behind
    assert ensure_default_model(cache_dir=tmp_path) == results[0]


def test_ensure_default_model_honours_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_PD_CACHE", str(tmp_path))
    d = ensure_default_model()
    assert d.parent == tmp_path / "models" and d.name.startswith("llama-")


def test_lora_adapter_is_peft_format_vllm_accepts_and_deterministic(tmp_path: Path) -> None:
    """vLLM's own PEFT reader takes the config; the tensors are PEFT's names and shapes, for
    modules vLLM's Llama supports (q_proj / k_proj are packed into qkv_proj)."""
    from vllm.lora.peft_helper import PEFTHelper

    spec = ModelSpec(**TINY)
    a = write_lora(spec, LoraSpec(rank=4, seed=3), tmp_path / "a")
    b = write_lora(spec, LoraSpec(rank=4, seed=3), tmp_path / "b")
    assert all((a / n).read_bytes() == (b / n).read_bytes() for n in ADAPTER_FILES)
    peft = PEFTHelper.from_local_dir(str(a), max_position_embeddings=None)
    assert peft.r == 4 and peft.vllm_lora_scaling_factor == 1.0
    with safe_open(a / "adapter_model.safetensors", "pt") as f:
        p = "base_model.model.model.layers.0.self_attn"
        assert list(f.get_slice(f"{p}.q_proj.lora_A.weight").get_shape()) == [4, spec.hidden]
        assert list(f.get_slice(f"{p}.k_proj.lora_B.weight").get_shape()) == [spec.kv_heads * spec.head_dim, 4]
    other = write_lora(spec, LoraSpec(rank=4, seed=4), tmp_path / "c")
    assert (other / "adapter_model.safetensors").read_bytes() != (a / "adapter_model.safetensors").read_bytes()


def test_cli_writes_lora_beside_the_model_and_refuses_it_for_mla(tmp_path: Path) -> None:
    tiny = [
        "--layers",
        "1",
        "--hidden",
        "64",
        "--heads",
        "2",
        "--kv-heads",
        "1",
        "--head-dim",
        "32",
        "--intermediate",
        "128",
        "--vocab",
        "600",
    ]
    assert cli.main(["make-model", str(tmp_path / "m"), *tiny, "--lora", str(tmp_path / "l"), "--lora-rank", "2"]) == 0
    assert json.loads((tmp_path / "l" / "adapter_config.json").read_text())["r"] == 2
    with pytest.raises(SystemExit, match="--lora"):
        cli.main(["make-model", str(tmp_path / "mla"), "--arch", "deepseek_v2", "--lora", str(tmp_path / "l2")])
    assert not (tmp_path / "mla").exists()
    with pytest.raises(ModelSpecError, match="--lora-rank"):
        LoraSpec(rank=0)


def test_ensure_lora_is_cached_per_model_and_adapter(tmp_path: Path) -> None:
    first = ensure_lora(ModelSpec(**TINY), cache_dir=tmp_path)
    assert ensure_lora(ModelSpec(**TINY), cache_dir=tmp_path) == first
    assert ensure_lora(ModelSpec(**TINY), LoraSpec(seed=2), cache_dir=tmp_path) != first
    assert (first / "adapter_config.json").is_file()


# vLLM serving the made adapter (with --enable-lora) is proven by tests/e2e/test_store_isolation_e2e.py.
# vLLM serving the made model (completions and chat) is proven by every end-to-end test:
# their reference phase (tests/conftest.py reference_outputs) runs the whole prompt catalogue on it.
