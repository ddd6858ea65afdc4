rule preprocess:
    input:
        model=rules.base_model.output[0],
    output:
        directory(f"{RESULTS}/preprocess"),
    params:
        stage=stage_key("preprocess", "data", "seed"),
        inputs=named_inputs,
    shell:
        LAUNCH
