"""The application above the library: the `pact` CLI and the main job (`pact finetune`), the embedded default
model and data, and the held-out evaluation. The only part of `optimum_pact` that imports peft, `peft_ext` or
`trainer_callbacks`; nothing else in `optimum_pact` imports it."""
