# Runs infkv-video (EXE) with the Gemma 3 270M text model (MODEL) and a random-weight projector
# for it (MMPROJ). MODE video: 14 frames of a real video (VIDEO, 4 frames/s, through ffmpeg) with
# 4 facts between the first frames, asked after 2 and 10 further frames, budget 256, with keydiff,
# h2o and the full cache: every frame's record must show a cache within budget + block (exactly
# the budget once the input exceeds it), held = frame tokens + text tokens, the full cache holding
# every token and evicting none, 8 answers per policy with a log-probability per candidate; the
# program itself checks the session's positions against llama_memory_seq_pos_min/max after every
# frame. MODE images: a folder of three copies of IMAGE streams three image frames; one image with
# more --frames than it has ends with a note. MODE bad_media: a missing file, a text file, an
# audio file, a video without frames, a folder holding a non-image, a projector of another width
# (MISMATCH) and a block smaller than a frame each fail with a message naming the argument.
# MODE mrope: MODE video's run with a tiny random Qwen2-VL model and projector (MODEL, MMPROJ:
# M-RoPE, each frame's rows at one t): every frame kept whole or evicted whole, the cache within
# the budget (not exactly: a whole frame may not fit what is left) and budget + block; a projector
# of another width (MISMATCH) refused.
function(run_video what)
  file(REMOVE ${OUT})
  execute_process(COMMAND ${EXE} --model ${MODEL} --mmproj ${MMPROJ} ${ARGN} --threads 1 --progress 0 --json ${OUT}
                  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "infkv-video ${what} failed (${rc}):\n${out}\n${err}")
  endif()
  message(STATUS "${out}")
  file(READ ${OUT} j)
  set(json "${j}" PARENT_SCOPE)
endfunction()

# Fails unless infkv-video with ARGN exits non-zero with stderr matching REGEX.
function(refused regex)
  execute_process(COMMAND ${EXE} --model ${MODEL} --threads 1 ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out
                  ERROR_VARIABLE err)
  if(rc EQUAL 0 OR NOT err MATCHES "${regex}")
    message(FATAL_ERROR "infkv-video ${ARGN}: expected a failure matching '${regex}', got ${rc}:\n${out}\n${err}")
  endif()
  message(STATUS "refused as expected: ${err}")
endfunction()

# Checks run `r` of `json`: `frames` records; held split by modality; `answers` answers with
# `candidates` log-probabilities each; and by `kind`: full (holding everything), exact (within
# budget + block, exactly the budget once the input exceeds it) or whole (within budget + block
# and the budget, every frame held whole or not at all).
function(check_run r frames budget kind answers)
  string(JSON policy GET "${json}" runs ${r} policy)
  string(JSON block GET "${json}" runs ${r} block)
  string(JSON n LENGTH "${json}" runs ${r} frames)
  if(NOT n EQUAL frames)
    message(FATAL_ERROR "${policy}: expected ${frames} frame records, got ${n}")
  endif()
  math(EXPR cap "${budget} + ${block}")
  math(EXPR last "${n} - 1")
  foreach(i RANGE ${last})
    foreach(k input input_frames input_text held held_frames held_text peak evicted kv_state_bytes rss_bytes
              frames_held frames_whole)
      string(JSON ${k} GET "${json}" runs ${r} frames ${i} ${k})
    endforeach()
    math(EXPR sum "${held_frames} + ${held_text}")
    math(EXPR in_sum "${input_frames} + ${input_text}")
    if(NOT sum EQUAL held OR NOT in_sum EQUAL input OR kv_state_bytes LESS_EQUAL 0 OR rss_bytes LESS_EQUAL 0)
      message(FATAL_ERROR "${policy} frame ${i}: held ${held} != ${held_frames} + ${held_text}, or input ${input} != "
                          "${input_frames} + ${input_text}, or no memory figures")
    endif()
    if(kind STREQUAL "full")
      if(NOT held EQUAL input OR NOT evicted EQUAL 0)
        message(FATAL_ERROR "${policy} frame ${i}: the full cache holds ${held} of ${input}, evicted ${evicted}")
      endif()
    elseif(kind STREQUAL "whole" AND NOT frames_held EQUAL frames_whole)
      message(FATAL_ERROR "${policy} frame ${i}: ${frames_held} frames held, only ${frames_whole} whole")
    elseif(peak GREATER cap OR held GREATER budget OR (kind STREQUAL "exact" AND input GREATER budget
                                                        AND NOT held EQUAL budget))
      message(FATAL_ERROR "${policy} frame ${i}: peak ${peak} (cap ${cap}), held ${held} (budget ${budget}) "
                          "after ${input} tokens")
    endif()
  endforeach()
  if(NOT kind STREQUAL "full" AND evicted EQUAL 0)
    message(FATAL_ERROR "${policy}: evicted nothing")
  endif()
  if(answers GREATER 0)
    string(JSON n_ans LENGTH "${json}" runs ${r} answers)
    if(NOT n_ans EQUAL answers)
      message(FATAL_ERROR "${policy}: expected ${answers} answers, got ${n_ans}")
    endif()
    string(JSON n_lp LENGTH "${json}" runs ${r} answers 0 logprobs)
    string(JSON n_cand LENGTH "${json}" facts 0 candidates)
    if(NOT n_lp EQUAL n_cand)
      message(FATAL_ERROR "${policy}: ${n_lp} log-probabilities for ${n_cand} candidates")
    endif()
  endif()
endfunction()

if(MODE STREQUAL "video" OR MODE STREQUAL "mrope")
  run_video("on a video" --media ${VIDEO} --fps 4 --frames 14 --facts 4 --ask-after 2,10 --budget 256
            --policy keydiff,h2o,full)
  string(JSON version GET "${json}" version)
  if(NOT version MATCHES "^infkv-video ")
    message(FATAL_ERROR "version line: ${version}")
  endif()
  set(kind exact)
  if(MODE STREQUAL "mrope")
    set(kind whole)
  endif()
  check_run(0 14 256 ${kind} 8)
  check_run(1 14 256 ${kind} 8)
  check_run(2 14 256 full 8)
  if(MODE STREQUAL "mrope")  # and a projector of another width refused with this model too
    refused("--mmproj = [^\n]*: mtmd_init_from_file refused it" --mmproj ${MISMATCH} --media ${IMAGE})
  endif()
  string(JSON frame_tokens GET "${json}" runs 0 frames 0 input_frames)
  if(frame_tokens LESS 16)
    message(FATAL_ERROR "a frame took ${frame_tokens} tokens")
  endif()
elseif(MODE STREQUAL "images")
  set(dir ${OUT}.images)
  file(REMOVE_RECURSE ${dir})
  foreach(i 1 2 3)
    configure_file(${IMAGE} ${dir}/frame${i}.jpeg COPYONLY)
  endforeach()
  run_video("on a folder of images" --media ${dir} --facts 1 --ask-after 2 --budget 100 --policy keydiff)
  check_run(0 3 100 exact 1)
  run_video("on one image" --media ${IMAGE} --facts 0 --frames 3 --budget 100 --policy streaming_llm)
  string(JSON note GET "${json}" runs 0 note)
  if(NOT note MATCHES "the media ended after 1 frames")
    message(FATAL_ERROR "one image, 3 frames asked: note '${note}'")
  endif()
elseif(MODE STREQUAL "bad_media")
  set(dir ${OUT}.bad)
  file(REMOVE_RECURSE ${dir})
  file(WRITE ${dir}/notes.txt "not an image\n")
  file(WRITE ${dir}/folder/a.txt "not an image either\n")
  refused("--media: Path does not exist" --mmproj ${MMPROJ} --media ${dir}/missing.mp4)
  refused("--media = [^\n]*notes.txt: mtmd reads it neither as an image nor as a video" --mmproj ${MMPROJ} --media
          ${dir}/notes.txt)
  refused("--media = [^\n]*test-2.mp3: mtmd reads it neither" --mmproj ${MMPROJ} --media ${AUDIO})
  refused("--media = [^\n]*folder: [^\n]*a.txt is not an image" --mmproj ${MMPROJ} --media ${dir}/folder)
  # A video without frames (ffmpeg writes an MP4 of 0 frames): ffprobe finds no stream to read.
  execute_process(COMMAND ffmpeg -v error -y -f lavfi -i color=c=red:s=64x64:r=4 -frames:v 0 -c:v mpeg4
                          ${dir}/no_frames.mp4 RESULT_VARIABLE rc ERROR_VARIABLE err)
  if(NOT rc EQUAL 0 OR NOT EXISTS ${dir}/no_frames.mp4)
    message(FATAL_ERROR "ffmpeg could not write a video without frames (${rc}): ${err} (scripts/setup.sh installs it)")
  endif()
  refused("--media = [^\n]*no_frames.mp4: mtmd reads it neither as an image nor as a video \\(an unknown format, or a video without frames\\)"
          --mmproj ${MMPROJ} --media ${dir}/no_frames.mp4)
  refused("--mmproj = [^\n]*: mtmd_init_from_file refused it" --mmproj ${MISMATCH} --media ${IMAGE})
  refused("--block = 10: a frame takes 64 tokens" --mmproj ${MMPROJ} --media ${IMAGE} --block 10 --facts 0 --frames 1)
else()
  message(FATAL_ERROR "MODE = ${MODE}: not video, mrope, images or bad_media")
endif()
