# One evaluation per model named in evaluate.models (base, sft, dpo or an rl variant) and, for the methods
# (dpo, rl variants), per seed of the grid; base and sft are evaluated once, with the shared seed.
def model_dir(wildcards):
    if wildcards.model in SEEDED_MODELS:
        return f"{RESULTS}/dpo/seed{wildcards.seed}" if wildcards.model == "dpo" else \
            f"{RESULTS}/rl/{wildcards.model}/seed{wildcards.seed}"
    return {"base": rules.base_model.output[0], "sft": rules.sft.output[0]}[wildcards.model]


def evaluated_runs():
    """(model, seed) of every evaluation the report shows, in the order of evaluate.models."""
    return [(model, seed) for model in config["evaluate"]["models"]
            for seed in (SEEDS if model in SEEDED_MODELS else [config["seed"]])]


rule evaluate:
    input:
        model=model_dir,
        reference=rules.base_model.output[0],
        data=rules.preprocess.output[0],
    output:
        directory(f"{RESULTS}/evaluate/{{model}}/seed{{seed}}"),
    wildcard_constraints:
        model="|".join(["base", "sft", *SEEDED_MODELS]),
        seed=r"\d+",
    params:
        stage=stage_key("evaluate", "evaluate"),
        inputs=named_inputs,
    shell:
        LAUNCH
