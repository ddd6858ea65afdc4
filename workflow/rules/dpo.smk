rule dpo:
    input:
        model=rules.sft.output[0],
        data=rules.preprocess.output[0],
    output:
        directory(f"{RESULTS}/dpo"),
    params:
        stage=stage_key("dpo", "dpo", "seed"),
        inputs=named_inputs,
    shell:
        LAUNCH
