rule reward_model:
    input:
        model=rules.sft.output[0],
        data=rules.preprocess.output[0],
    output:
        directory(f"{RESULTS}/reward_model"),
    params:
        stage=stage_key("reward_model", "reward_model", "seed"),
        inputs=named_inputs,
    shell:
        LAUNCH
