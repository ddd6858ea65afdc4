# One DPO run per seed of the grid (`seeds`), all from the same SFT model.
rule dpo:
    input:
        model=rules.sft.output[0],
        data=rules.preprocess.output[0],
    output:
        directory(f"{RESULTS}/dpo/seed{{seed}}"),
    wildcard_constraints:
        seed=r"\d+",
    params:
        stage=stage_key("dpo", "dpo"),
        inputs=named_inputs,
    shell:
        LAUNCH
