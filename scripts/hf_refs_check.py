"""Compares a GGUF that convert_hf_to_gguf.py made from a Hugging Face twin with the sweep GGUF
the twin was written from (run by scripts/hf-refs.sh, gguf-py from the llama.cpp sources on
PYTHONPATH): every tensor's type, dims and bytes, the sha256 of each file's tensor data, and the
metadata keys that differ. Prints one JSON object; exits 1 when a tensor differs in any way
other than those listed in ALLOWED (the reason beside each)."""
import hashlib
import json
import sys

import gguf
import numpy as np

# Tensors the converter computes itself, which may differ from the sweep's in the last bits.
ALLOWED = {
    # Llama 3's rotary factors: the converter evaluates the formula in float32 torch tensors,
    # the sweep generator (npu_gguf::synth::llama3_rope_factors) in f64 rounded once to f32.
    "rope_freqs.weight": "the converter computes the llama3 factors in float32",
}


def tensors(path):
    r = gguf.GGUFReader(path)
    return r, {t.name: t for t in r.tensors}


def raw(t):
    return np.asarray(t.data).view(np.uint8).tobytes()


def field(r, k):
    f = r.fields[k]
    try:
        return f.contents()
    except Exception:  # noqa: BLE001 - an odd field still counts as present
        return None


def main(orig_path, conv_path):
    ro, a = tensors(orig_path)
    rc, b = tensors(conv_path)
    differ, missing, extra, notes = [], sorted(set(a) - set(b)), sorted(set(b) - set(a)), {}
    ha, hb = hashlib.sha256(), hashlib.sha256()
    for name in sorted(set(a) & set(b)):
        ta, tb = a[name], b[name]
        da, db = raw(ta), raw(tb)
        ha.update(name.encode() + da)
        hb.update(name.encode() + db)
        same = (ta.tensor_type == tb.tensor_type and list(ta.shape) == list(tb.shape)
                and da == db)
        if not same:
            differ.append(name)
            va = np.asarray(ta.data, dtype=np.float32).ravel()
            vb = np.asarray(tb.data, dtype=np.float32).ravel()
            if va.shape == vb.shape:
                notes[name] = {
                    "types": [ta.tensor_type.name, tb.tensor_type.name],
                    "values_differing": int((va != vb).sum()), "of": int(va.size),
                    "max_abs_diff": float(np.abs(va - vb).max()),
                    "why": ALLOWED.get(name, "unexplained"),
                }
            else:
                notes[name] = {"shapes": [list(ta.shape), list(tb.shape)],
                               "why": ALLOWED.get(name, "unexplained")}
    keys_a = {k for k in ro.fields if not k.startswith("GGUF.")}
    keys_b = {k for k in rc.fields if not k.startswith("GGUF.")}
    meta_changed = sorted(k for k in keys_a & keys_b
                          if not k.startswith("general.") and field(ro, k) != field(rc, k))
    out = {
        "tensors": len(a),
        "tensors_equal": len(a) - len(differ) - len(missing),
        "tensors_differing": notes,
        "tensors_missing_in_converted": missing,
        "tensors_added_by_converter": extra,
        "tensor_data_sha256_original": ha.hexdigest(),
        "tensor_data_sha256_converted": hb.hexdigest(),
        "metadata_only_in_original": sorted(keys_a - keys_b),
        "metadata_only_in_converted": sorted(keys_b - keys_a),
        "metadata_changed": meta_changed,
        "tokenizer_pre": field(rc, "tokenizer.ggml.pre") if "tokenizer.ggml.pre" in rc.fields
        else None,
    }
    print(json.dumps(out, separators=(",", ":")))
    bad = missing or extra or any(n not in ALLOWED for n in differ)
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
