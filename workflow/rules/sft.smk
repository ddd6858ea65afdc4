rule sft:
    input:
        model=rules.base_model.output[0],
        data=rules.preprocess.output[0],
    output:
        directory(f"{RESULTS}/sft"),
    params:
        stage=stage_key("sft", "sft", "seed"),
        inputs=named_inputs,
    shell:
        LAUNCH
