"""A Hugging Face causal LM as HF users train it, and the glue that tunes it (docs/huggingface.md).

`train.py` is the script: a Llama built from a config (nothing downloaded) in two sizes (``--size
tiny``, the default, and ``gpu``: 32 M parameters), trained by a plain loop or by the HF Trainer,
runnable without autotune. `workload.py` makes its job an autotune workload (``hf-causal-lm``, a
preset per size, the script's own get_batch as the probe's data path) with
`autotune.workloads.hf.HFCausalLM`; ``train --config best.yaml`` runs a recommended config
(autotune.apply in the loop, training_arguments for the Trainer).
"""
