-- wrk script of benchmarks/dataplane_bench.py: every request carries an x-api-key taken
-- round-robin from COUNT distinct keys PREFIX-0 .. PREFIX-(COUNT-1), starting at OFFSET.
--
--   wrk -t1 -c50 -d6s --latency -s benchmarks/wrk/keys.lua URL -- PREFIX COUNT OFFSET
--
-- COUNT 1 sends one fixed key (the flood rows). The requests are formatted once, in
-- init(), so request() costs a table lookup: the load generator stays cheap.

local requests = {}
local count = 1
local next_index = 0

function init(args)
  local prefix = args[1] or "bench"
  count = tonumber(args[2] or "10000")
  local offset = tonumber(args[3] or "0")
  for i = 0, count - 1 do
    local headers = {}
    for name, value in pairs(wrk.headers) do
      headers[name] = value
    end
    headers["x-api-key"] = prefix .. "-" .. i
    requests[i + 1] = wrk.format(nil, nil, headers)
  end
  next_index = offset % count
end

function request()
  next_index = next_index + 1
  if next_index > count then
    next_index = 1
  end
  return requests[next_index]
end
