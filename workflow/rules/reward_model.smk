rule reward_model:
    input:
        unpack(given_model("reward_model")),
        model=start_model,
        data=preprocessed("pairs"),
    output:
        directory(f"{RESULTS}/reward_model"),
    message:
        f"reward_model: using the given reward model {config['reward_model']['from']} (evaluated, not trained)"
        if config["reward_model"]["from"] else None
    priority: PRIORITY["reward_model"]
    log:
        f"{RESULTS}/logs/reward_model.log",
    params:
        stage=stage_key("reward_model", "reward_model", "seed"),
        job_io=job_io,
        launch=launch,
    shell:
        LAUNCH
