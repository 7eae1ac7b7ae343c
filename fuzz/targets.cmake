# fuzz/targets.cmake: the list of fuzz targets and the libraries each one's parser needs, read by both builds:
# the libFuzzer build (fuzz/CMakeLists.txt, -DMOETRON_FUZZ=ON) and the replay tests of the normal build
# (tests/CMakeLists.txt, fuzz.replay.*). ENGINE_IO stands for the engine's file readers (safetensors,
# checkpoints, token shards, the manifest, the tokenizer): the whole engine library in the normal build, just
# those sources in the fuzz build.
set(MOETRON_FUZZ_TARGETS config hf_config pp_layout schedule_csv pipeline_record safetensors shard
  dataset_manifest tokenizer checkpoint)
set(MOETRON_FUZZ_LIBS_config moetron_job)
set(MOETRON_FUZZ_LIBS_hf_config moetron_job)
set(MOETRON_FUZZ_LIBS_pp_layout moetron_schedule)
set(MOETRON_FUZZ_LIBS_schedule_csv moetron_schedule)
set(MOETRON_FUZZ_LIBS_pipeline_record moetron_schedule)
set(MOETRON_FUZZ_LIBS_safetensors ENGINE_IO)
set(MOETRON_FUZZ_LIBS_shard ENGINE_IO)
set(MOETRON_FUZZ_LIBS_dataset_manifest ENGINE_IO)
set(MOETRON_FUZZ_LIBS_tokenizer ENGINE_IO)
set(MOETRON_FUZZ_LIBS_checkpoint ENGINE_IO moetron_job)

# The libraries target `t` links when ENGINE_IO means `engine_io`.
function(moetron_fuzz_libs t engine_io out)
  set(libs ${MOETRON_FUZZ_LIBS_${t}})
  list(TRANSFORM libs REPLACE "^ENGINE_IO$" "${engine_io}")
  set(${out} ${libs} PARENT_SCOPE)
endfunction()
