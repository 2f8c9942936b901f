"""What every online trainer shares: the `OnlineTrainerMixin` and `OnlineConfig`, checkpoints, the multi-model
wrapper (`ModelParts`) and the logged metrics and completion tables."""
