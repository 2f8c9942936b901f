"""What the trainers share: the `OnlineTrainerMixin` and `OnlineConfig`, the one `train` / `save_model` their mixins
hook into (`lifecycle`), checkpoint writing (`checkpoint`) and resuming (`resume`), the multi-model wrapper
(`ModelParts`) and the logged metrics and completion tables (`metrics`). The algorithm's pieces (advantages, KL
control, reward normalisation) are in `trl_ext.ops`, twist learning in `trl_ext.trainers.twist`."""
