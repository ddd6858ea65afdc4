"""What the stages run on, inside their jobs: models, data, losses, advantages, LoRA, the DeepSpeed rank, Ray actor
groups, the trainer loop, checkpoints, vLLM rollouts, tracking, progress lines, the Ray bring-up and the job
runner itself. One module per job; see the README's layout table."""
