rule base_model:
    output:
        directory(f"{RESULTS}/base_model"),
    params:
        stage=stage_key("base_model", "model", "seed"),
        inputs=named_inputs,
    shell:
        LAUNCH
