--[[ lateness: the run-length coded lateness of a move reply.

lateness_runs()
  Returns add(late, n), which records n moves ``late`` ms after their due time, and
  finish(reply), which appends them to reply run-length coded: a run of n > 1 equal values
  is -n followed by the value, so a burst due at one instant costs two integers. A lateness
  past MAX_LATE_MS (a score written by hand, -inf) is recorded as MAX_LATE_MS: Redis would
  turn an infinite one into a negative integer, read as a run.
]]
local MAX_LATE_MS = 2 ^ 53
local function lateness_runs()
  local runs = {}
  local run_value, run_count = nil, 0
  local function end_run()
    if run_count == 1 then
      runs[#runs + 1] = run_value
    elseif run_count > 1 then
      runs[#runs + 1] = -run_count
      runs[#runs + 1] = run_value
    end
  end
  local function add(late, n)
    if not (late <= MAX_LATE_MS) then late = MAX_LATE_MS end  -- also NaN
    if late == run_value then run_count = run_count + n else
      end_run()
      run_value, run_count = late, n
    end
  end
  local function finish(reply)
    end_run()
    run_value, run_count = nil, 0
    for i = 1, #runs do reply[#reply + 1] = runs[i] end
  end
  return add, finish
end
