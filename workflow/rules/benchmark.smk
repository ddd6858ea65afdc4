# One job per benchmark of `benchmarks`, model of evaluate.models and seed (methods: each seed of the grid; base and
# sft: the shared seed). A job's cache key is its own benchmark's settings: adding a benchmark runs only its jobs.
rule benchmark:
    input:
        unpack(benchmark_inputs),
        model=model_dir,
    output:
        directory(f"{RESULTS}/benchmark/{{name}}/{{model}}/seed{{seed}}"),
    wildcard_constraints:
        name="|".join(map(re.escape, config["benchmarks"])) or "(?!)",  # (no benchmarks: no job)
        model="|".join(["base", *["sft"] * STAGES["sft"], *SEEDED_MODELS]),
        seed=r"\d+",
    log:
        f"{RESULTS}/logs/benchmark-{{name}}-{{model}}-seed{{seed}}.log",
    params:
        stage=stage_key("benchmark", derive=lambda wc: benchmark_params(config, wc.name, wc.model, int(wc.seed))),
        job_io=job_io,
        launch=launch,
    shell:
        LAUNCH
