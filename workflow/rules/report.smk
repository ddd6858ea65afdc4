# The paper's tables and figures, built from the MLflow runs of the stages below (each input's stage.json names
# its run). `snakemake --report <file>.html` packs the figures and tables with the rule graph and captions.
rule report:
    input:
        evaluations=[f"{RESULTS}/evaluate/{model}/seed{seed}" for model, seed in evaluated_runs()],
        sft=rules.sft.output[0],
        reward_model=rules.reward_model.output[0],
        dpo=expand(rules.dpo.output[0], seed=SEEDS),
        rl=expand(rules.rl.output[0], variant=RL_VARIANTS, seed=SEEDS),
    output:
        report(directory(f"{RESULTS}/report"), patterns=["{name}.png", "{name}.csv"],
               caption="../report/results.rst", category="Results"),
    log:
        f"{RESULTS}/logs/report.log",
    params:
        stage=stage_key("report", "evaluate", "model", "data",
                        derive=lambda wc: {"variants": {name: rl_variant(config, name) for name in RL_VARIANTS}}),
        job_io=job_io,
        launch=launch,
    shell:
        LAUNCH
