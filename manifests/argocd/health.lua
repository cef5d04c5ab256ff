-- Argo CD health check for serving.pdd.dev/PDDeployment.
-- Healthy:     Ready=True for the current generation.
-- Degraded:    Validated=False; Stalled=True (kstatus: the operator cannot write an object
--              and retrying will not help, e.g. a ResourceQuota or PodSecurity refusal, or one
--              of its names held by an object it does not own); or a role unavailable for a
--              reason that waiting will not fix (a pod the scheduler cannot place, a crash
--              loop, an image that cannot be pulled).
-- Progressing: anything else (the operator has not seen this generation yet, pods starting,
--              a controlled roll replacing pods).
local hs = {}
local stuck = {
  Unschedulable = true, CrashLooping = true, ImagePullFailed = true,
  ContainerCreateFailed = true, PodFailed = true,
}

local function condition(kind)
  if obj.status == nil or obj.status.conditions == nil then
    return nil
  end
  for _, c in ipairs(obj.status.conditions) do
    if c.type == kind then
      return c
    end
  end
  return nil
end

local generation = obj.metadata.generation
if obj.status == nil or obj.status.observedGeneration == nil then
  hs.status = "Progressing"
  hs.message = "Waiting for the pdd operator to observe the PDDeployment"
  return hs
end
if generation ~= nil and obj.status.observedGeneration < generation then
  hs.status = "Progressing"
  hs.message = "Waiting for the pdd operator to observe generation " .. generation
  return hs
end

local validated = condition("Validated")
if validated ~= nil and validated.status == "False" then
  hs.status = "Degraded"
  hs.message = validated.message
  return hs
end

local stalled = condition("Stalled")
if stalled ~= nil and stalled.status == "True" then
  hs.status = "Degraded"
  hs.message = stalled.message
  return hs
end

local ready = condition("Ready")
if ready ~= nil and ready.status == "True" and
    (ready.observedGeneration == nil or generation == nil or ready.observedGeneration == generation) then
  hs.status = "Healthy"
  hs.message = ready.message
  return hs
end

for _, kind in ipairs({"PrefillAvailable", "DecodeAvailable"}) do
  local c = condition(kind)
  if c ~= nil and c.status == "False" and stuck[c.reason] then
    hs.status = "Degraded"
    hs.message = c.message
    return hs
  end
end

hs.status = "Progressing"
if ready ~= nil and ready.message ~= nil and ready.message ~= "" then
  hs.message = ready.message
else
  hs.message = "Waiting for the PDDeployment to become Ready"
end
return hs
