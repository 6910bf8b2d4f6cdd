"""The reference trainer: launch the workers, build model and data, run the steps, log, save and
resume (``lowcomm train``); ``load_model`` reads a finished run back."""
