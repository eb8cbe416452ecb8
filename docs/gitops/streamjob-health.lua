-- Argo CD health check for keyshift.dev/StreamJob and keyshift.dev/StreamJobSnapshot (argocd-cm
-- keys resource.customizations.health.keyshift.dev_StreamJob and ..._StreamJobSnapshot;
-- docs/gitops.md).
-- It reads the status the way kstatus (Flux) does, so both tools agree:
--   observedGeneration behind metadata.generation -> Progressing (kstatus InProgress)
--   Stalled=True                                  -> Degraded    (kstatus Failed)
--   Reconciling=True or Ready=False               -> Progressing (kstatus InProgress)
--   Ready=True, suspended                         -> Suspended   (kstatus Current)
--   Ready=True                                    -> Healthy     (kstatus Current)
-- Only Lua's base and table libraries are used (Argo CD's default set has no string library).
local hs = {}

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

local function describe(c)
  if c.message ~= nil and c.message ~= "" then
    return c.reason .. ": " .. c.message
  end
  return c.reason
end

-- The CRD defaults status to {observedGeneration: 0} until the operator first writes it.
if obj.status == nil or obj.status.observedGeneration == nil or obj.status.observedGeneration == 0 then
  hs.status = "Progressing"
  hs.message = "Waiting for the keyshift operator to report the job's status"
  return hs
end

local generation = obj.metadata.generation
if generation ~= nil and obj.status.observedGeneration ~= generation then
  hs.status = "Progressing"
  hs.message = "Waiting for the keyshift operator to act on generation " .. tostring(generation)
    .. " (status describes generation " .. tostring(obj.status.observedGeneration) .. ")"
  return hs
end

local stalled = condition("Stalled")
if stalled ~= nil and stalled.status == "True" then
  hs.status = "Degraded"
  hs.message = describe(stalled)
  return hs
end

local reconciling = condition("Reconciling")
if reconciling ~= nil and reconciling.status == "True" then
  hs.status = "Progressing"
  hs.message = describe(reconciling)
  return hs
end

local ready = condition("Ready")
if ready ~= nil and ready.status == "True" then
  if obj.status.phase == "Suspended" then
    hs.status = "Suspended"
  else
    hs.status = "Healthy"
  end
  hs.message = describe(ready)
  return hs
end
if ready ~= nil then
  hs.status = "Progressing"
  hs.message = describe(ready)
  return hs
end

hs.status = "Progressing"
hs.message = "Waiting for the keyshift operator's Ready condition"
return hs
