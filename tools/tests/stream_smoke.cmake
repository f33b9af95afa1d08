# Runs infkv-stream (EXE). MODE smoke: 2000 tokens of TEXT through MODEL with budget 256, block
# 64 for streaming_llm and inf_mllm, one thread (robust on a loaded machine); the JSON (OUT) must
# hold one record per block, a cache that never exceeded budget + block nor kept more than the
# budget, and finite perplexities; its CSV must pass scripts/stream_soak_check.py (SOAK_CHECK, run
# with PYTHON): cache, host copies and RSS flat after the warm-up; three policies taking turns
# (--interleave) give every block the same result as one after another.
# MODE passkey: one passkey trial at distance 300 through a 128-slot cache: the full cache holds
# every token of the key statement at the question, StreamingLLM none; the same for three needle
# trials in TEXT (one of each kind; expected_attention runs them too, through the values it
# captures); three needles in one stream, each asked at distances 100 and 300 (every question
# at its distance, the full cache holding every key): asking leaves no trace, so the questions at
# 300 score the same whether the answers at 100 were 8 tokens long or 1; and a --skip run whose
# block token counts start after the skipped tokens. With --archive 4 --recall 32, SnapKV's needle
# run completes with every question asked; so do single-turn runs (--question-known, both
# --proxy ways) and whole segments (--whole-segments).
# MODE bad_flag: bad values must fail with a message naming the flag. MODE too_big: a budget no
# machine holds is refused at once, naming --budget.
# Runs EXE with ARGN on one thread, writing its JSON to OUT; fails naming WHAT unless it exits 0;
# sets `json` to the JSON.
function(run_stream what)
  file(REMOVE ${OUT})
  execute_process(COMMAND ${EXE} ${ARGN} --threads 1 --progress 0 --json ${OUT}
                  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "infkv-stream ${what} failed (${rc}):\n${out}\n${err}")
  endif()
  message(STATUS "${out}")
  file(READ ${OUT} j)
  set(json "${j}" PARENT_SCOPE)
endfunction()

if(MODE STREQUAL "smoke")
  set(tokens 2000)
  set(budget 256)
  set(block 64)
  run_stream("" --model ${MODEL} --text ${TEXT} --tokens ${tokens} --budget ${budget} --block ${block}
             --policy streaming_llm,inf_mllm --csv ${OUT}.csv)
  if(SOAK_CHECK)
    execute_process(COMMAND ${PYTHON} ${SOAK_CHECK} ${OUT}.csv RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
    if(NOT rc EQUAL 0)
      message(FATAL_ERROR "stream_soak_check failed (${rc}):\n${out}\n${err}")
    endif()
    message(STATUS "${out}")
  endif()
  string(JSON n_runs LENGTH "${json}" runs)
  if(NOT n_runs EQUAL 2)
    message(FATAL_ERROR "expected 2 runs (streaming_llm, inf_mllm), got ${n_runs}")
  endif()
  math(EXPR want_blocks "(${tokens} + ${block} - 1) / ${block}")
  math(EXPR cap "${budget} + ${block}")
  foreach(r RANGE 1)
    string(JSON policy GET "${json}" runs ${r} policy)
    string(JSON n LENGTH "${json}" runs ${r} blocks)
    if(NOT n EQUAL want_blocks)
      message(FATAL_ERROR "${policy}: expected ${want_blocks} blocks, got ${n}")
    endif()
    math(EXPR last "${n} - 1")
    set(evictions 0)
    foreach(i RANGE ${last})
      string(JSON peak GET "${json}" runs ${r} blocks ${i} slots_peak)
      string(JSON slots GET "${json}" runs ${r} blocks ${i} slots)
      string(JSON seen GET "${json}" runs ${r} blocks ${i} tokens)
      string(JSON ppl GET "${json}" runs ${r} blocks ${i} block_ppl)
      if(peak GREATER cap OR slots GREATER budget)
        message(FATAL_ERROR "${policy} block ${i}: ${peak} slots before and ${slots} after the eviction "
                            "(budget ${budget}, block ${block})")
      endif()
      if(seen GREATER budget AND NOT slots EQUAL budget)
        message(FATAL_ERROR "${policy} block ${i}: ${seen} tokens seen but ${slots} slots kept, not the budget")
      endif()
      if(ppl STREQUAL "" OR ppl STREQUAL "null" OR ppl LESS 1 OR ppl GREATER 10000)
        message(FATAL_ERROR "${policy} block ${i}: perplexity ${ppl} out of range")
      endif()
    endforeach()
    string(JSON total GET "${json}" runs ${r} blocks ${last} tokens)
    if(NOT total EQUAL tokens)
      message(FATAL_ERROR "${policy}: the last block ends at ${total} tokens, not ${tokens}")
    endif()
  endforeach()
  # streaming_llm reads nothing from the graph: its session copies nothing; inf_mllm's does.
  string(JSON cap0 GET "${json}" runs 0 time capture)
  string(JSON cap1 GET "${json}" runs 1 time capture)
  if(NOT cap0 EQUAL 0 OR NOT cap1 GREATER 0)
    message(FATAL_ERROR "capture seconds: streaming_llm ${cap0} (must be 0), inf_mllm ${cap1} (must be > 0)")
  endif()
  # --interleave: the policies take turns block by block, each on its own context: every block's
  # negative log-likelihood and kept slots equal the runs one after another.
  run_stream("sequential" --model ${MODEL} --text ${TEXT} --tokens 640 --budget ${budget} --block ${block}
             --policy streaming_llm,snapkv,keydiff)
  set(one_by_one "${json}")
  run_stream("--interleave" --model ${MODEL} --text ${TEXT} --tokens 640 --budget ${budget} --block ${block}
             --policy streaming_llm,snapkv,keydiff --interleave)
  foreach(r RANGE 2)
    string(JSON n LENGTH "${json}" runs ${r} blocks)
    math(EXPR last "${n} - 1")
    foreach(i RANGE ${last})
      foreach(field nll slots)
        string(JSON a GET "${one_by_one}" runs ${r} blocks ${i} ${field})
        string(JSON b GET "${json}" runs ${r} blocks ${i} ${field})
        if(NOT a STREQUAL b)
          message(FATAL_ERROR "--interleave: run ${r} block ${i}: ${field} ${b}, one after another ${a}")
        endif()
      endforeach()
    endforeach()
  endforeach()
  # llama.cpp's context shift: never beyond budget + block cells; when full, half of what
  # follows the sinks goes.
  run_stream("context_shift" --model ${MODEL} --text ${TEXT} --tokens 700 --budget ${budget} --block ${block}
             --policy context_shift)
  string(JSON n LENGTH "${json}" runs 0 blocks)
  math(EXPR last "${n} - 1")
  set(shifts 0)
  set(before 0)
  foreach(i RANGE ${last})
    string(JSON peak GET "${json}" runs 0 blocks ${i} slots_peak)
    string(JSON gone GET "${json}" runs 0 blocks ${i} evicted)
    if(peak GREATER cap)
      message(FATAL_ERROR "context_shift block ${i}: ${peak} slots (context of ${cap} cells)")
    endif()
    if(gone GREATER 0)
      math(EXPR shifts "${shifts} + 1")
      math(EXPR half "(${before} - 4) / 2")  # half of what followed the 4 sinks before the block
      math(EXPR room "${before} + ${block}")
      if(NOT gone EQUAL half OR NOT room GREATER cap)
        message(FATAL_ERROR "context_shift block ${i}: ${gone} of ${before} tokens discarded, not ${half}, "
                            "before a block of ${block} (context of ${cap} cells)")
      endif()
    endif()
    set(before ${peak})
  endforeach()
  if(shifts LESS 2)
    message(FATAL_ERROR "context_shift: ${shifts} shifts in 700 tokens through ${cap} cells")
  endif()
elseif(MODE STREQUAL "passkey")
  run_stream(--passkey --model ${MODEL} --passkey 300 --trials 1 --budget 128 --block 32 --policy full,streaming_llm)
  string(JSON full_kept GET "${json}" runs 0 trials 0 key_kept)
  string(JSON key_tokens GET "${json}" runs 0 trials 0 key_tokens)
  string(JSON window_kept GET "${json}" runs 1 trials 0 key_kept)
  if(key_tokens LESS 10 OR NOT full_kept EQUAL key_tokens OR NOT window_kept EQUAL 0)
    message(FATAL_ERROR "key statement of ${key_tokens} tokens: full kept ${full_kept} (all expected), "
                        "streaming_llm ${window_kept} (none expected)")
  endif()
  # With an archive and recall before each question: the run completes, the questions recall
  # what SnapKV's 128-slot cache lost, and the settings are recorded.
  run_stream(--recall --model ${MODEL} --text ${TEXT} --needle 300 --trials 3 --budget 128 --block 32
             --policy snapkv --archive 4 --recall 32)
  string(JSON bits GET "${json}" settings archive_bits)
  string(JSON recall GET "${json}" settings recall_tokens)
  string(JSON keep GET "${json}" settings keep_positions)
  string(JSON asked LENGTH "${json}" runs 0 trials)
  if(NOT bits EQUAL 4 OR NOT recall EQUAL 32 OR NOT keep OR NOT asked EQUAL 3)
    message(FATAL_ERROR "--archive 4 --recall 32: settings ${bits} / ${recall}, keep positions ${keep}, ${asked} "
                        "questions (3)")
  endif()
  # The same with compacted positions: recalled rows turned to where they land.
  run_stream(--compact-positions --model ${MODEL} --text ${TEXT} --needle 300 --trials 3 --budget 128 --block 32
             --policy snapkv --archive 4 --recall 32 --compact-positions)
  string(JSON keep GET "${json}" settings keep_positions)
  string(JSON asked LENGTH "${json}" runs 0 trials)
  if(keep OR NOT asked EQUAL 3)
    message(FATAL_ERROR "--archive 4 --recall 32 --compact-positions: keep positions ${keep}, ${asked} questions (3)")
  endif()
  # Single turn: each question's prompt prefilled with SnapKV's evictions scoring against its
  # queries (both ways of computing them) completes with every question asked and the settings
  # recorded; whole segments with KeyDiff likewise.
  foreach(proxy after_cache alone)
    run_stream(--question-known --model ${MODEL} --text ${TEXT} --needle 300 --trials 3 --budget 128 --block 32
               --policy full,snapkv --question-known --proxy ${proxy})
    string(JSON known GET "${json}" settings question_known)
    string(JSON how GET "${json}" settings proxy)
    string(JSON asked LENGTH "${json}" runs 1 trials)
    if(NOT known OR NOT how STREQUAL proxy OR NOT asked EQUAL 3)
      message(FATAL_ERROR "--question-known --proxy ${proxy}: settings ${known} / ${how}, ${asked} questions (3)")
    endif()
  endforeach()
  run_stream(--whole-segments --model ${MODEL} --text ${TEXT} --needle 300 --trials 3 --budget 128 --block 32
             --policy keydiff --whole-segments)
  string(JSON whole GET "${json}" settings whole_segments)
  string(JSON asked LENGTH "${json}" runs 0 trials)
  if(NOT whole OR NOT asked EQUAL 3)
    message(FATAL_ERROR "--whole-segments: setting ${whole}, ${asked} questions (3)")
  endif()
  # A quantized full cache (q4_0: 4.5 bits an element) beside SnapKV on it: the bytes reported are
  # the q4_0 cache's, 9/32 of f16's, and every question is asked.
  run_stream(--cache-type --model ${MODEL} --text ${TEXT} --needle 300 --trials 3 --budget 128 --block 32
             --policy full,snapkv --cache-type q4_0)
  string(JSON ct GET "${json}" settings cache_type)
  string(JSON at GET "${json}" runs 0 trials 0 asked_at)
  string(JSON bytes GET "${json}" runs 0 trials 0 cache_bytes)
  string(JSON layers GET "${json}" model_shape layers)
  string(JSON kv_heads GET "${json}" model_shape kv_heads)
  string(JSON head_dim GET "${json}" model_shape head_dim)
  string(JSON asked LENGTH "${json}" runs 1 trials)
  math(EXPR f16_bytes "${at} * ${layers} * 2 * ${kv_heads} * ${head_dim} * 2")
  math(EXPR q4_bytes "${f16_bytes} * 9 / 32")
  if(NOT ct STREQUAL "q4_0" OR NOT bytes EQUAL q4_bytes OR NOT asked EQUAL 3)
    message(FATAL_ERROR "--cache-type q4_0: setting ${ct}, the full cache's ${bytes} bytes at ${at} tokens "
                        "(${q4_bytes} expected), SnapKV asked ${asked} questions (3)")
  endif()
  run_stream(--needle --model ${MODEL} --text ${TEXT} --needle 300 --trials 3 --budget 128 --block 32
             --policy full,streaming_llm,expected_attention)
  # The JSON names the program that made it and the needle protocol (scripts/eval_sweep.py's record).
  execute_process(COMMAND ${EXE} --version OUTPUT_VARIABLE version OUTPUT_STRIP_TRAILING_WHITESPACE)
  string(JSON json_version GET "${json}" version)
  string(JSON protocol GET "${json}" needle protocol)
  if(NOT json_version STREQUAL version OR NOT version MATCHES "^infkv-stream " OR NOT protocol EQUAL 2)
    message(FATAL_ERROR "--needle JSON: version \"${json_version}\" (--version: \"${version}\"), protocol ${protocol} (2)")
  endif()
  set(kinds number word fact)
  foreach(t RANGE 2)
    string(JSON kind GET "${json}" runs 0 trials ${t} kind)
    list(GET kinds ${t} want)
    string(JSON full_kept GET "${json}" runs 0 trials ${t} key_kept)
    string(JSON key_tokens GET "${json}" runs 0 trials ${t} key_tokens)
    string(JSON window_kept GET "${json}" runs 1 trials ${t} key_kept)
    string(JSON ea_answer GET "${json}" runs 2 trials ${t} answer)  # fails unless expected_attention ran the trial
    if(NOT kind STREQUAL want OR key_tokens LESS 4 OR NOT full_kept EQUAL key_tokens OR NOT window_kept EQUAL 0)
      message(FATAL_ERROR "needle trial ${t}: kind ${kind} (${want} expected), statement of ${key_tokens} tokens: "
                          "full kept ${full_kept} (all expected), streaming_llm ${window_kept} (none expected)")
    endif()
  endforeach()
  # Three needles in one stream, each asked at 100 and 300; --gen 8, then --gen 1.
  set(multi --model ${MODEL} --text ${TEXT} --needle 100,300 --needles 3 --needle-gap 64 --trials 3 --budget 128
            --block 32 --policy full,streaming_llm)
  foreach(gen 8 1)
    run_stream(--needles ${multi} --gen ${gen})
    set(logp_${gen} "")
    foreach(r RANGE 1)
      string(JSON n LENGTH "${json}" runs ${r} trials)
      if(NOT n EQUAL 6)
        message(FATAL_ERROR "--needles 3 --needle 100,300: run ${r} asked ${n} questions, 6 expected")
      endif()
      foreach(t RANGE 5)
        string(JSON d GET "${json}" runs ${r} trials ${t} distance)
        string(JSON kept GET "${json}" runs ${r} trials ${t} key_kept)
        string(JSON key_tokens GET "${json}" runs ${r} trials ${t} key_tokens)
        string(JSON lp GET "${json}" runs ${r} trials ${t} needle_logprob)
        if(NOT (d EQUAL 100 OR d EQUAL 300) OR (r EQUAL 0 AND NOT kept EQUAL key_tokens))
          message(FATAL_ERROR "--needles 3: question ${t} of run ${r} at distance ${d}, ${kept}/${key_tokens} key tokens")
        endif()
        if(d EQUAL 300)
          list(APPEND logp_${gen} ${lp})
        endif()
      endforeach()
    endforeach()
  endforeach()
  if(NOT logp_8 STREQUAL logp_1 OR logp_8 STREQUAL "")
    message(FATAL_ERROR "the questions at distance 300 scored ${logp_8} after 8-token answers at 100, but ${logp_1} "
                        "after 1-token answers: asking left something in the cache")
  endif()
  # Live prefetching on the text stream: after each eviction a recall for the window's queries
  # (the session's recall time is counted), the settings recorded.
  run_stream(--prefetch --model ${MODEL} --text ${TEXT} --tokens 320 --budget 128 --block 32 --policy snapkv
             --archive 4 --prefetch 16)
  string(JSON prefetch GET "${json}" settings prefetch_tokens)
  string(JSON recall_s GET "${json}" runs 0 time recall)
  string(JSON blocks LENGTH "${json}" runs 0 blocks)
  if(NOT prefetch EQUAL 16 OR NOT recall_s GREATER 0 OR NOT blocks EQUAL 10)
    message(FATAL_ERROR "--archive 4 --prefetch 16: prefetch_tokens ${prefetch}, recall ${recall_s} s (> 0), "
                        "${blocks} blocks (10)")
  endif()
  run_stream(--skip --model ${MODEL} --text ${TEXT} --skip 1000 --tokens 96 --budget 64 --block 32 --policy streaming_llm)
  string(JSON first GET "${json}" runs 0 blocks 0 tokens)
  string(JSON last GET "${json}" runs 0 blocks 2 tokens)
  if(NOT first EQUAL 1032 OR NOT last EQUAL 1096)
    message(FATAL_ERROR "--skip 1000: blocks end at ${first} .. ${last} tokens, expected 1032 .. 1096")
  endif()
elseif(MODE STREQUAL "too_big")
  # A budget no machine holds fails at once, naming --budget, before llama.cpp allocates anything.
  execute_process(COMMAND ${EXE} --model ${MODEL} --text ${TEXT} --tokens 100 --budget 2000000000 --policy snapkv
                  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err TIMEOUT 60)
  if(rc EQUAL 0 OR NOT err MATCHES "--budget = 2000000000: snapkv needs .* MiB of memory are available")
    message(FATAL_ERROR "infkv-stream --budget 2000000000: exit ${rc}, expected a one-line refusal:\n${err}")
  endif()
elseif(MODE STREQUAL "bad_flag")
  foreach(args "--budget;0" "--policy;no_such_policy" "--block;-3" "--budget;20" "--skip;5;--passkey;100" "--archive;3"
               "--recall;8" "--recall;8;--archive;4;--keep-positions;--passkey;100" "--prefetch;8"
               "--compact-positions" "--compact-positions;--archive;4;--keep-positions"
               "--question-known" "--question-known;--passkey;100" "--proxy;later"
               "--whole-segments;--policy;saddle_union;--passkey;100" "--cache-type;q5_1"
               "--cache-type;q4_0;--archive;4" "--position-gap;-1" "--position-gap;4;--keep-positions"
               "--position-gap;4;--archive;4;--recall;8" "--position-gap;4;--archive;4;--compact-positions;--recall;8")
    execute_process(COMMAND ${EXE} --model ${CMAKE_CURRENT_LIST_FILE} --text ${CMAKE_CURRENT_LIST_FILE} ${args}
                            --policy streaming_llm,snapkv
                    RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
    list(GET args 0 flag)
    if(rc EQUAL 0)
      message(FATAL_ERROR "infkv-stream ${args} succeeded; it must fail")
    endif()
    if(NOT err MATCHES "${flag}")
      message(FATAL_ERROR "infkv-stream ${args} failed without naming ${flag}:\n${err}")
    endif()
  endforeach()
else()
  message(FATAL_ERROR "unknown MODE ${MODE}")
endif()
