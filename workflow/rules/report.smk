rule report:
    input:
        evaluations=expand(f"{RESULTS}/evaluate/{{model}}", model=config["evaluate"]["models"]),
        training=[MODEL_DIRS[m] for m in config["evaluate"]["models"] if m != "base"],
        reward_model=rules.reward_model.output[0],
    output:
        directory(f"{RESULTS}/report"),
    params:
        stage=stage_key("report", "evaluate"),
        inputs=named_inputs,
    shell:
        LAUNCH
