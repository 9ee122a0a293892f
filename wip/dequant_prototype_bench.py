import ctypes, torch, time
torch.set_num_threads(1)
lib = ctypes.CDLL("/tmp/cgc/dq.so")
L,nb,bs,h,d=8,2,128,4,128; half=d//2
chunk=torch.zeros(L*nb*h*2*bs*d*2,dtype=torch.uint8)
kv=chunk.view(torch.bfloat16).view(L,nb,h,2,bs,d).permute(0,3,1,4,2,5)  # [L,2,nb,bs,h,d]
o=kv[:,0]   # [L,nb,bs,h,d]
q=torch.randint(0,255,(L,nb,bs,h,half),dtype=torch.uint8)
s=torch.rand(L,h,d); b=-7*s
# rows = L*nb*bs (token rows); row offset in elements from chunk base
rows = L*nb*bs
st = o.stride()  # elements
base = o.data_ptr()
idx = torch.arange(rows)
l = idx // (nb*bs); blk = (idx // bs) % nb; t = idx % bs
row_off = (l*st[0] + blk*st[1] + t*st[2]).to(torch.int64).contiguous()
def run():
    lib.kvf_dequant_nibbles(ctypes.c_void_p(q.data_ptr()), ctypes.c_int64(rows), ctypes.c_int64(h), ctypes.c_int64(half),
        ctypes.c_void_p(row_off.data_ptr()), ctypes.c_int64(st[3]), ctypes.c_void_p(s.data_ptr()), ctypes.c_void_p(b.data_ptr()),
        ctypes.c_int64(nb*bs), ctypes.c_void_p(base))
run()
ref = torch.empty(L,nb,bs,h,d)
ref[..., :half] = (q & 15).float() * s[:,None,None,:, :half] + b[:,None,None,:, :half]
ref[..., half:] = (q >> 4).float() * s[:,None,None,:, half:] + b[:,None,None,:, half:]
print("max err vs torch (bf16 rounding)", float((o.float()-ref).abs().max()), float(ref.abs().max()))
n=50; t=time.perf_counter()
for _ in range(n): run()
dt=(time.perf_counter()-t)/n
print("C kernel", round(dt*1e3,3), "ms per kind;", round(o.numel()*2/dt/1e9,2), "GB/s of bf16 out")
sb = s.view(L,1,1,h,d); bb = b.view(L,1,1,h,d)
def tv():
    torch.addcmul(bb[..., :half], q & 15, sb[..., :half], out=o[..., :half]); torch.addcmul(bb[..., half:], q >> 4, sb[..., half:], out=o[..., half:])
tv(); t=time.perf_counter()
for _ in range(n): tv()
dt2=(time.perf_counter()-t)/n
print("torch", round(dt2*1e3,3), "ms per kind")
