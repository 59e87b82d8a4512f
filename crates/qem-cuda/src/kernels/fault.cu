// A deliberate illegal store, so tests can check how a lost GPU context is reported (issue 17):
// after it every CUDA call of the process fails, and the engine must say so plainly.
extern "C" __global__ void qem_inject_fault(unsigned int* p) { *p = 0xdeadu; }
