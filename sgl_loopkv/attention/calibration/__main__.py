from sgl_loopkv.attention.calibration.streaming import main

main()
