import torch, random
from transformers import AutoModelForCausalLM
torch.manual_seed(0)
m = AutoModelForCausalLM.from_pretrained("/root/.cache/kvferry/tiny-llama", torch_dtype=torch.float32)
m.eval()
rng = random.Random(7)
def quant(x, bins):  # x [b, h, t, d]: per channel (h, d) over tokens
    L = bins // 2 - 1
    amax = x.abs().amax(2, keepdim=True)
    s = torch.where(amax > 0, amax / L, torch.ones_like(amax))
    return torch.round(x / s) * s
for bins in (16, 32, 64, 254, 0):
    flips, gaps, diffs = 0, [], []
    for i in range(8):
        n = rng.choice([300, 600, 1000])
        ids = torch.tensor([[rng.randrange(100, 2000) for _ in range(n)]])
        with torch.no_grad():
            out = m(ids[:, :-1], use_cache=True)
            pkv = out.past_key_values
            exact = m(ids[:, -1:], past_key_values=pkv).logits[0, -1]
            out2 = m(ids[:, :-1], use_cache=True)
            pkv2 = out2.past_key_values
            for layer in pkv2.layers if hasattr(pkv2, "layers") else []:
                if bins:
                    layer.keys.copy_(quant(layer.keys.to(torch.bfloat16).float(), bins))
                    layer.values.copy_(quant(layer.values.to(torch.bfloat16).float(), bins))
                else:  # bf16 rounding only
                    layer.keys.copy_(layer.keys.to(torch.bfloat16).float())
                    layer.values.copy_(layer.values.to(torch.bfloat16).float())
            pert = m(ids[:, -1:], past_key_values=pkv2).logits[0, -1]
        le, lp = exact.log_softmax(-1), pert.log_softmax(-1)
        top = le.topk(2).values
        gaps.append(float(top[0] - top[1]))
        flips += int(le.argmax() != lp.argmax())
        diffs.append(float((le - lp).abs().max()))
    print("bins", bins or "bf16 only", "flips", flips, "/ 8", "max logprob diff", round(max(diffs), 4), "gaps", [round(g, 3) for g in gaps])
