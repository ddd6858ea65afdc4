rule report:
    input:
        evaluations=expand(f"{RESULTS}/evaluate/{{model}}", model=config["evaluate"]["models"]),
        training=[rules.sft.output[0], rules.dpo.output[0]],
        rl=expand(f"{RESULTS}/rl/{{variant}}", variant=RL_VARIANTS),
        reward_model=rules.reward_model.output[0],
    output:
        directory(f"{RESULTS}/report"),
    params:
        stage=stage_key("report", "evaluate"),
        inputs=named_inputs,
    shell:
        LAUNCH
