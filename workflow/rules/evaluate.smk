# One evaluation per model named in evaluate.models: base, sft, dpo or an rl variant.
MODEL_DIRS = {
    "base": rules.base_model.output[0],
    "sft": rules.sft.output[0],
    "dpo": rules.dpo.output[0],
} | {variant: f"{RESULTS}/rl/{variant}" for variant in RL_VARIANTS}


rule evaluate:
    input:
        model=lambda wc: MODEL_DIRS[wc.model],
        reference=rules.base_model.output[0],
        data=rules.preprocess.output[0],
    output:
        directory(f"{RESULTS}/evaluate/{{model}}"),
    wildcard_constraints:
        model="|".join(MODEL_DIRS),
    params:
        stage=stage_key("evaluate", "evaluate", "seed"),
        inputs=named_inputs,
    shell:
        LAUNCH
